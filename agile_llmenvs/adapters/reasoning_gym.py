"""reasoning-gym datasets as single-turn ``TextEnv``\\ s (the ``envs`` extra).

Row ``i`` of the dataset is task ``i``: ``reset(row_index=i)`` asks its question, and the one
``step`` scores the answer with the dataset's own ``score_answer``. An answer inside
``<answer>...</answer>`` tags is scored alone; otherwise the whole reply is.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from agile_llmenvs.errors import EnvBuildError, OptionalDependencyError

__all__ = ["ReasoningGymEnv", "make", "reasoning_gym_factory"]


class ReasoningGymEnv:
    """One reasoning-gym dataset, one question per episode."""

    max_turns = 1

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.dataset_size = len(dataset)
        self._entry: dict[str, Any] | None = None

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        """Ask the question of row ``row_index`` (default 0)."""
        row = int(task.get("row_index", 0))
        if not 0 <= row < self.dataset_size:
            raise IndexError(
                f"row_index {row} is outside this dataset's 0..{self.dataset_size - 1}"
            )
        self._entry = self.dataset[row]
        return str(self._entry["question"]), {"row_index": row}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Score the reply; the episode always ends."""
        if self._entry is None:
            raise RuntimeError("step() before reset()")
        from reasoning_gym.utils import extract_answer

        answer = extract_answer(action, tag_name="answer")
        answer = (answer if answer is not None else action).strip()
        score = float(self.dataset.score_answer(answer, self._entry))
        info = {"answer": answer, "expected": self._entry["answer"], "success": score >= 1.0}
        return "", score, True, False, info

    def close(self) -> None:
        """Nothing to release."""


def reasoning_gym_factory(
    name: str, *, size: int, seed: int, **kwargs: Any
) -> Callable[[], ReasoningGymEnv]:
    """A factory of envs over one reasoning-gym dataset, built once and shared.

    Raises:
        OptionalDependencyError: ``reasoning-gym`` is not installed.
        EnvBuildError: reasoning-gym has no dataset ``name`` or refuses ``kwargs``.
    """
    dataset = _dataset(name, size, seed, json.dumps(kwargs, sort_keys=True))
    return lambda: ReasoningGymEnv(dataset)


def make(name: str, *, size: int = 1000, seed: int = 0, **kwargs: Any) -> ReasoningGymEnv:
    """One env over reasoning-gym dataset ``name`` (``factory:
    agile_llmenvs.adapters.reasoning_gym:make`` with the name as the entrypoint). The dataset
    is generated once per ``(name, size, seed, kwargs)`` and shared by every env."""
    return reasoning_gym_factory(name, size=size, seed=seed, **kwargs)()


@functools.lru_cache(maxsize=32)
def _dataset(name: str, size: int, seed: int, kwargs_json: str) -> Any:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise OptionalDependencyError(
            "reasoning-gym", extra="envs", feature=f"the reasoning-gym env {name!r}"
        ) from exc
    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **json.loads(kwargs_json))
    except Exception as exc:  # unknown names raise ValueError, bad kwargs TypeError
        raise EnvBuildError(f"reasoning-gym could not build dataset {name!r}: {exc}") from exc
