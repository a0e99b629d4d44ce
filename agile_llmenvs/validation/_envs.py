"""The checks of an env section: its files, rows and imports, and (for an entrypoint) one env
built and closed; and the envs of an eval config."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any

from agile_llmenvs.errors import ManifestError
from agile_llmenvs.specs import BanditEnvSpec, GymEnvSpec, LLMEnvSpec, OfflineEnvSpec
from agile_llmenvs.specs.llm import HOSTING_FIELDS, ROW_FIELDS
from agile_llmenvs.validation._problems import Found, Problem, importable, installed

__all__ = [
    "check_bandit_env",
    "check_gym_env",
    "check_llm_env",
    "is_hosted",
    "reasoning_gym_dataset",
]


def is_hosted(spec: LLMEnvSpec) -> bool:
    """Whether the env is placed on Ray env hosts (then validate does not build it)."""
    return any(f in spec.model_fields_set and getattr(spec, f) for f in HOSTING_FIELDS)


def check_llm_env(found: Found, spec: LLMEnvSpec, seed: int, *, build: bool) -> None:
    """A rollout or dataset env: its files, rows, rubric, imports and (with ``build``) one env."""
    rows_found = found.exists("env.dataset_path", spec.dataset_path)
    found.exists("env.chat_template_path", spec.chat_template_path)
    if spec.rubric_file_path is not None and found.exists(
        "env.rubric_file_path", spec.rubric_file_path
    ):
        from agile_llmenvs.llm_envs.rubric import load_rubric

        path, name = spec.rubric_file_path, spec.rubric_name
        found.attempt("env.rubric_file_path", lambda: load_rubric(path, name), LLMEnvSpec)
    if rows_found and any(getattr(spec, f) for f in ROW_FIELDS):
        _rows(found, spec, seed)
    if spec.entrypoint is not None:
        from agile_llmenvs.transport.resolve import ensure_env_packages

        packages = spec.env_packages
        if found.attempt(
            "env.env_packages", lambda: ensure_env_packages(packages, allow_install=False)
        ):
            if spec.factory is not None:
                imported = found.attempt("env.factory", importable(spec.factory))
            else:
                imported = found.attempt("env.entrypoint", importable(spec.entrypoint))
            if imported and build and not is_hosted(spec):
                found.attempt("env.entrypoint", _one_env_built(spec, seed), LLMEnvSpec)
    if spec.observation_processor is not None:
        found.attempt("env.observation_processor", importable(spec.observation_processor))
    hosted = [f for f in HOSTING_FIELDS if f in spec.model_fields_set and getattr(spec, f)]
    if hosted and spec.entrypoint is not None:
        found.attempt(f"env.{hosted[0]}", installed("ray", "ray", "env hosts"))


def _one_env_built(spec: LLMEnvSpec, seed: int) -> Callable[[], object]:
    """A check that one env of an entrypoint spec builds, as training builds it, and closes."""

    def check() -> None:
        from agile_llmenvs.envs.rollout import building
        from agile_llmenvs.llm_envs.from_spec import text_env_factory

        make_env = text_env_factory(spec, seed=seed)
        with building(spec):  # the env's own constructor: in training's words
            env = make_env()
        close = getattr(env, "close", None)
        if callable(close):
            close()

    return check


def _rows(found: Found, spec: LLMEnvSpec, seed: int) -> None:
    """The rows load, have the columns the env reads, and leave some to train on."""
    from agile_llmenvs.llm_envs.rows import load_rows

    source = next(f for f in ROW_FIELDS if getattr(spec, f))
    unmapped = spec.model_copy(update={"columns": None})
    splits: list[Any] = []
    if not found.attempt(f"env.{source}", lambda: splits.extend(load_rows(unmapped, seed))):
        return
    if spec.columns:
        present = splits[0].column_names
        absent = [column for column in spec.columns.values() if column not in present]
        if absent:
            found.append(
                Problem(
                    "env.columns",
                    f"maps to the column {absent[0]!r}, which the rows do not have (they have "
                    f"{present}); map each env column to one of theirs",
                )
            )
            return
        splits.clear()
        if not found.attempt("env.columns", lambda: splits.extend(load_rows(spec, seed))):
            return
    train = splits[0]
    if spec.env_type == "dataset":  # the columns DatasetEnv reads
        response = spec.response_column or "response"
        needed = (
            ("prompt", response) if spec.objective == "sft" else ("prompt", "chosen", "rejected")
        )
        absent = [name for name in needed if name not in train.column_names]
        if absent and absent[0] == spec.response_column:
            found.append(
                Problem(
                    "env.response_column",
                    f"the rows have no column {absent[0]!r} (they have {train.column_names}); "
                    "name the column that holds the response",
                )
            )
        elif absent:
            found.append(
                Problem(
                    "env.columns",
                    f"the rows have no column {absent[0]!r} (they have {train.column_names}); "
                    f"map one to it, e.g. columns: {{{absent[0]}: your_column}}",
                )
            )
    elif len(train) == 0:
        found.append(
            Problem(
                "env.train_test_split", "holds out every row; lower it to leave rows to train on"
            )
        )
    elif spec.rubric_file_path is not None:
        from agile_llmenvs.llm_envs.rubric import RubricEnv

        first, template = train.select(range(1)).to_list(), spec.prompt_template
        found.attempt(
            "env.columns", lambda: RubricEnv(first, _no_score, prompt_template=template), LLMEnvSpec
        )


def _no_score(completion: str, answer: Any, **row: Any) -> float:
    """A stand-in rubric, to check that rows fit the env without scoring any."""
    return 0.0


def check_gym_env(found: Found, spec: GymEnvSpec, *, multi_agent: bool) -> None:
    """A gym or offline env: its files, its builder and its wrappers import."""
    file_found = found.exists("env.path", spec.path)
    if isinstance(spec.env_config, str):
        from agile_llmenvs._imports import load_env_config

        config = spec.env_config
        found.attempt("env.env_config", lambda: load_env_config(config), GymEnvSpec)
    if isinstance(spec, OfflineEnvSpec):
        found.exists("env.dataset_path", spec.dataset_path)
    if file_found:  # else there is nothing to import from
        _gym_builder(found, spec, multi_agent=multi_agent)
    for index, entry in enumerate(spec.env_wrappers or []):
        target = entry if isinstance(entry, str) else entry[0]
        found.attempt(f"env.env_wrappers.{index}", importable(target))


def _gym_builder(found: Found, spec: GymEnvSpec, *, multi_agent: bool) -> None:
    """What builds the env resolves: the factory, the entrypoint, or the registry id."""
    if spec.factory is not None:
        found.attempt("env.factory", importable(spec.factory, file=spec.path))
    elif spec.entrypoint is not None:
        found.attempt("env.entrypoint", importable(spec.entrypoint, file=spec.path))
    elif multi_agent:
        found.attempt("env.name", _pettingzoo_module(spec.env_id))
    else:
        found.attempt("env.name", _gym_registered(spec.env_id))


def _gym_registered(env_id: str) -> Callable[[], object]:
    def check() -> None:
        import gymnasium

        try:
            gymnasium.spec(env_id)
        except gymnasium.error.Error as exc:
            raise ManifestError(
                f"{exc} Register it, or build it from an `entrypoint` (or `factory`)"
            ) from exc

    return check


def _pettingzoo_module(module: str) -> Callable[[], object]:
    def check() -> None:
        if not hasattr(importlib.import_module(module), "parallel_env"):
            raise ManifestError(f"{module!r} has no `parallel_env`: name a PettingZoo env module")

    return check


def check_bandit_env(found: Found, spec: BanditEnvSpec) -> None:
    """A bandit env: its data files, and its entrypoint imports."""
    found.exists("env.features", spec.features)
    found.exists("env.targets", spec.targets)
    if found.exists("env.path", spec.path) and spec.entrypoint is not None:
        found.attempt("env.entrypoint", importable(spec.entrypoint, file=spec.path))


def reasoning_gym_dataset(name: str) -> Callable[[], object]:
    """A check that reasoning-gym is installed and has the dataset ``name``."""

    def check() -> None:
        installed("reasoning-gym", "envs", f"the reasoning-gym env {name!r}")()
        from reasoning_gym.factory import DATASETS

        if name not in DATASETS:
            close = difflib.get_close_matches(name, list(DATASETS), n=1)
            hint = f"did you mean {close[0]!r}?" if close else "see reasoning_gym.factory.DATASETS"
            raise ManifestError(f"reasoning-gym has no dataset {name!r}; {hint}")

    return check
