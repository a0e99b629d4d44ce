"""Validating one file: read it, tell a run manifest from an eval config, validate its fields,
then check what it names; and how the outcome is printed."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from agile_llmenvs._yaml import safe_load
from agile_llmenvs.errors import ManifestError
from agile_llmenvs.specs import BanditEnvSpec, LLMEnvSpec, RunManifest, TrainingSpec
from agile_llmenvs.specs.manifest import size_refusal
from agile_llmenvs.validation._envs import (
    check_bandit_env,
    check_gym_env,
    check_llm_env,
    is_hosted,
    reasoning_gym_dataset,
)
from agile_llmenvs.validation._models import check_eval_model, check_model
from agile_llmenvs.validation._problems import Found, Problem, importable, installed, problems_of

__all__ = [
    "Validation",
    "check_eval_config",
    "check_run_manifest",
    "describe_manifest",
    "problem_lines",
    "report_lines",
    "validate_file",
]

Kind = Literal["run manifest", "eval config"]

# Each optional package a training setting needs: (the setting is on, its field, the package,
# the extra that installs it, what it is for).
_TRAINING_PACKAGES: tuple[tuple[Callable[[TrainingSpec], bool], str, str, str, str], ...] = (
    (lambda t: t.lora is not None, "lora", "peft", "train", "LoRA adapters"),
    (lambda t: t.generation_backend == "vllm", "generation_backend", "vllm", "vllm", "vLLM"),
    (lambda t: t.tensorboard is True, "tensorboard", "tensorboard", "train", "TensorBoard"),
    (lambda t: "tensorboard" in t.report_to, "report_to", "tensorboard", "train", "TensorBoard"),
    (lambda t: "wandb" in t.report_to, "report_to", "wandb", "trackers", "W&B tracking"),
    (lambda t: "mlflow" in t.report_to, "report_to", "mlflow", "trackers", "MLflow tracking"),
    (lambda t: "trackio" in t.report_to, "report_to", "trackio", "trackers", "Trackio tracking"),
)


@dataclass(frozen=True)
class Validation:
    """The outcome of validating one file.

    Attributes:
        path: The file.
        kind: What it was read as: a run manifest, or an eval config (a file with an
            ``environments`` list and no ``env`` section).
        summary: What the file declares, when its fields validated.
        problems: Each problem found.
        error: Why the file could not be read at all (then there are no problems).
        manifest: The run manifest, when its fields validated (a command that goes on to
            run it need not load it again).
    """

    path: Path
    kind: Kind
    summary: str = ""
    problems: tuple[Problem, ...] = ()
    error: str | None = None
    manifest: RunManifest | None = None

    @property
    def ok(self) -> bool:
        """Whether the file passed every check."""
        return self.error is None and not self.problems


def validate_file(path: str | Path, *, check_files: bool = True, build: bool = True) -> Validation:
    """Validate a run manifest or an eval config, told apart by their top-level keys.

    Args:
        path: A ``.yaml``, ``.yml`` or ``.json`` file.
        check_files: Also check the files, imports, model and packages it names (otherwise
            only its fields are validated).
        build: With ``check_files``, also build (and close) one env of a rollout manifest's
            ``entrypoint``, so a constructor that rejects its ``env_config`` fails here.
    """
    path = Path(path)
    try:
        data = _read(path)
    except OSError as exc:
        return Validation(path, "run manifest", error=f"cannot read it: {exc.strerror or exc}")
    except ManifestError as exc:
        return Validation(path, "run manifest", error=str(exc))
    if isinstance(data, dict) and "environments" in data and "env" not in data:
        return _validate_eval_config(path, check_files)
    return _validate_run_manifest(path, check_files, build)


def report_lines(result: Validation) -> list[str]:
    """How ``validate`` prints a file that failed its checks: a line naming the file and how
    many problems it has, then one indented line per problem."""
    if result.error is not None:
        return [f"error {result.path}: {result.error}"]
    lines = [f"error {result.path}: {result.kind}, {len(result.problems)} problem(s)"]
    return lines + [f"  {problem}" for problem in result.problems]


def problem_lines(result: Validation) -> list[str]:
    """How a command that runs the file (``train``) prints the same problems: one line each,
    naming the file, in ``validate``'s words."""
    if result.error is not None:
        return [f"error {result.path}: {result.error}"]
    return [f"error {result.path}: {problem}" for problem in result.problems]


def check_run_manifest(manifest: RunManifest, *, build: bool = True) -> list[Problem]:
    """The problems a manifest whose fields are valid would meet as its run starts: missing
    files, rubric functions or imports, a model path that is no model, packages not installed,
    and (with ``build``) an entrypoint env whose constructor fails on its ``env_config``.
    """
    found = Found()
    env = manifest.env
    if isinstance(env, LLMEnvSpec):
        check_llm_env(found, env, manifest.seed, build=build)
    elif isinstance(env, BanditEnvSpec):
        check_bandit_env(found, env)
    else:
        check_gym_env(found, env, multi_agent=manifest.multi_agent)
    check_model(found, manifest.model)
    training = manifest.training
    for is_on, name, package, extra, feature in _TRAINING_PACKAGES:
        if training is not None and is_on(training):
            found.attempt(f"training.{name}", installed(package, extra, feature))
    return found


def check_eval_config(config: Any) -> list[Problem]:
    """The problems a valid :class:`~agile_llmenvs.config.EvalConfig` would meet as
    ``agile-llmenvs eval`` starts: an unknown reasoning-gym dataset, an entry point that does
    not import, a model path that is no model, a backend's package or API key missing."""
    found = Found()
    for index, environment in enumerate(config.environments):
        where = f"environments.{index}"
        if environment.source == "reasoning_gym":
            found.attempt(f"{where}.name", reasoning_gym_dataset(environment.name))
        elif environment.source == "entry_point":
            found.attempt(f"{where}.entry_point", importable(environment.entry_point))
    check_eval_model(found, config.model)
    return found


def describe_manifest(manifest: RunManifest) -> str:
    """One line saying what a manifest declares: its run, env and training algorithm."""
    env = manifest.env
    if isinstance(env, LLMEnvSpec):
        what = f"{env.env_type} env {env.label!r}"
        what += f" ({env.objective})" if env.objective else f" from {env.source}"
    else:
        name = getattr(env, "env_id", env.name)
        what = f"{env.env_type} env {name!r} x{env.num_envs}"
    if manifest.training is not None:
        what += f", trained with {manifest.training.algorithm}"
    return f"run {manifest.name!r}: {what}" if manifest.name else what


def _read(path: Path) -> Any:
    refusal = size_refusal(path)  # before it is parsed: that alone takes seconds
    if refusal is not None:
        raise ManifestError(refusal)
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            return safe_load(text)
        if suffix == ".json":
            return json.loads(text)
    except Exception as exc:  # yaml's and json's errors, and the alias-bomb guard's
        raise ManifestError(f"not valid {suffix[1:].upper()}: {exc}") from exc
    raise ManifestError(f"expected a .yaml, .yml or .json file, got {suffix!r}")


def _validate_run_manifest(path: Path, check_files: bool, build: bool) -> Validation:
    from agile_llmenvs.specs import RunManifest, load_manifest

    try:
        manifest = load_manifest(path)
    except ValidationError as exc:
        return Validation(path, "run manifest", problems=tuple(problems_of(exc, RunManifest)))
    summary = describe_manifest(manifest)
    if not check_files:
        return Validation(
            path, "run manifest", f"{summary} (--no-files: fields only)", manifest=manifest
        )
    problems = tuple(check_run_manifest(manifest, build=build))
    unbuilt = _not_built(manifest.env, build)
    return Validation(path, "run manifest", f"{summary}{unbuilt}", problems, manifest=manifest)


def _not_built(env: Any, build: bool) -> str:
    """What the summary says of an entrypoint env validate did not build."""
    if not (isinstance(env, LLMEnvSpec) and env.source == "entrypoint"):
        return ""
    if not build:
        return " (--no-build: env not built)"
    return " (env not built: it runs on Ray env hosts)" if is_hosted(env) else ""


def _validate_eval_config(path: Path, check_files: bool) -> Validation:
    from agile_llmenvs.config import EvalConfig

    try:
        config = EvalConfig.from_yaml(path)
    except ValidationError as exc:
        return Validation(path, "eval config", problems=tuple(problems_of(exc, EvalConfig)))
    names = ", ".join(environment.name for environment in config.environments)
    plural = "s" if len(config.environments) > 1 else ""
    summary = (
        f"eval config: {len(config.environments)} environment{plural} ({names}), model "
        f"{config.model.model!r} on {config.model.backend}"
    )
    if not check_files:
        return Validation(path, "eval config", f"{summary} (--no-files: fields only)")
    return Validation(path, "eval config", summary, tuple(check_eval_config(config)))
