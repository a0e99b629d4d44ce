"""Rubrics and the single-turn env they score: labelled rows + a reward function."""

from __future__ import annotations

import inspect
import math
import string
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agile_llmenvs._imports import load_module_file
from agile_llmenvs.errors import EnvBuildError

__all__ = ["Rubric", "RubricEnv", "load_rubric", "render_prompt"]

Rubric = Callable[..., float]
"""``rubric(completion, answer, **row) -> float``: scores one completion against its row."""


def load_rubric(path: str | Path, name: str | None = None) -> Rubric:
    """The reward function ``name`` of the Python file at ``path``.

    A rubric file holds named reward functions ``fn(completion, answer, **row) -> float``;
    without ``name`` the file must define exactly one.

    Raises:
        EnvBuildError: the file is missing, or ``name`` is not one of its functions.
    """
    path = Path(path)
    if not path.is_file():
        raise EnvBuildError(f"rubric_file_path: {str(path)!r} is not a file")
    module_functions = _functions(path)
    if name is None:
        if len(module_functions) != 1:
            raise EnvBuildError(
                f"rubric_file_path: {path.name} defines "
                f"{sorted(module_functions)}; set rubric_name to pick one"
            )
        return next(iter(module_functions.values()))
    if name not in module_functions:
        raise EnvBuildError(
            f"rubric_name: {name!r} is not a reward function of {path.name}; "
            f"it defines {sorted(module_functions)}"
        )
    return module_functions[name]


def _functions(path: Path) -> dict[str, Rubric]:
    module = load_module_file(path)
    return {
        name: fn
        for name, fn in vars(module).items()
        if inspect.isfunction(fn) and not name.startswith("_") and fn.__module__ == module.__name__
    }


def render_prompt(row: Mapping[str, Any], template: Mapping[str, Any] | None) -> str:
    """The row's prompt: ``template["user"]`` formatted with the row, else its ``question``
    (or ``prompt``) column.

    Raises:
        EnvBuildError: the template names a column the row lacks, or there is no prompt.
    """
    if template is not None:
        unknown = set(template) - {"user"}
        if unknown:
            raise EnvBuildError(f"prompt_template: unknown keys {sorted(unknown)}; use 'user'")
        text = str(template["user"])
        fields = {f for _, f, _, _ in string.Formatter().parse(text) if f}
        missing = sorted(fields - set(row))
        if missing:
            raise EnvBuildError(
                f"prompt_template: the row has no column {missing[0]!r}; it has {sorted(row)}"
            )
        return text.format(**row)
    for column in ("question", "prompt"):
        if column in row:
            return str(row[column])
    raise EnvBuildError(
        f"the rows have no 'question' or 'prompt' column (they have "
        f"{sorted(row)}); map one with `columns` or set a prompt_template"
    )


class RubricEnv:
    """A single-turn text env over labelled rows, scored by a rubric.

    ``reset(row_index=i)`` shows row ``i``'s prompt; the one ``step`` scores the completion
    with ``rubric(completion, answer, **row)`` divided by ``max_reward``. A rubric that raises
    or returns a non-finite number scores 0.0 and reports why in ``info["rubric_error"]``: a
    bad rubric fails its episode, not the run.

    Args:
        rows: The labelled rows (each a mapping with at least ``answer``).
        rubric: The reward function.
        prompt_template: ``{"user": "... {column} ..."}``; default: the ``question`` column.
        max_reward: Scores are divided by this.
    """

    max_turns = 1

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        rubric: Rubric,
        *,
        prompt_template: Mapping[str, Any] | None = None,
        max_reward: float | None = None,
    ) -> None:
        if len(rows) == 0:
            raise EnvBuildError("a rubric env needs at least one row")
        if "answer" not in rows[0]:
            raise EnvBuildError(
                f"the rows have no 'answer' column (they have "
                f"{sorted(rows[0])}); map one with `columns`"
            )
        render_prompt(rows[0], prompt_template)  # fail at build time, not mid-run
        self.rows, self.rubric = rows, rubric
        self.prompt_template, self.max_reward = prompt_template, max_reward or 1.0
        self.dataset_size = len(rows)
        self._row: Mapping[str, Any] | None = None

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        """Show row ``row_index``'s prompt."""
        index = int(task.get("row_index", 0))
        if not 0 <= index < self.dataset_size:
            raise IndexError(f"row_index {index} is outside the {self.dataset_size} rows")
        self._row = self.rows[index]
        return render_prompt(self._row, self.prompt_template), {"row_index": index}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Score the completion; the episode ends."""
        if self._row is None:
            raise RuntimeError("step() before reset()")
        row = dict(self._row)
        info: dict[str, Any] = {
            "question": render_prompt(row, self.prompt_template),
            "answer": row["answer"],
        }
        try:
            score = float(self.rubric(action, row.pop("answer"), **row))
            if not math.isfinite(score):
                raise ValueError(f"the rubric returned {score}")
            reward = score / self.max_reward
        except Exception as exc:
            reward = 0.0
            info["rubric_error"] = f"{type(exc).__name__}: {exc}"
        return "", reward, True, False, info

    def close(self) -> None:
        """Nothing to release."""
