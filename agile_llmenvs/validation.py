"""What ``agile-llmenvs validate`` checks: a run manifest or an eval config, from its fields
to the files, imports and model it names, without loading weights.

First the fields (pydantic); then, unless ``check_files=False``, that each file a run reads
exists (dataset rows and ``env_config`` files also parse, and rows have the columns the env
reads), that rubric functions, entrypoints, factories, wrappers and processors import, that a
model path is a local model folder whose config and tokenizer load, and that the optional
packages the settings need are installed; unless ``build=False``, one env of a rollout
manifest's ``entrypoint`` is built with its ``env_config`` (as training builds it) and closed.
Nothing is downloaded and no server is contacted: an ``env_url`` is taken as given, an env
placed on Ray env hosts is not built here, and a model path that is not on disk is an error
even when it names a hub model. Each problem names its field path (``env.rubric_name``) and
says how to fix it.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from agile_llmenvs._imports import LOOKED_UP
from agile_llmenvs._yaml import safe_load
from agile_llmenvs.errors import (
    AgileLLMEnvsError,
    ManifestError,
    OptionalDependencyError,
)
from agile_llmenvs.specs import (
    BanditEnvSpec,
    GymEnvSpec,
    LLMEnvSpec,
    ModelSpec,
    OfflineEnvSpec,
    RunManifest,
    TrainingSpec,
)
from agile_llmenvs.specs.llm import HOSTING_FIELDS, ROW_FIELDS
from agile_llmenvs.specs.manifest import size_refusal

__all__ = [
    "Problem",
    "Validation",
    "check_eval_config",
    "check_run_manifest",
    "describe_manifest",
    "problem_lines",
    "problems_of",
    "report_lines",
    "validate_file",
]

Kind = Literal["run manifest", "eval config"]

_ENV_TAGS = ("gym", "offline", "rollout", "dataset", "bandit")
# A message that starts with the field it is about, as the specs' rules write them.
_FIELD_FIRST = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*): (.+)$", re.S)
_LOOKED_UP = f" {LOOKED_UP}"
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")
_API_KEY_ENV = {
    "openai": "OPENAI_API_KEY",
    "anthropic": "ANTHROPIC_API_KEY",
    "openrouter": "OPENROUTER_API_KEY",
}
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
class Problem:
    """One thing wrong with a manifest or config: the field path, and what to do about it."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


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


def problems_of(exc: ValidationError) -> list[Problem]:
    """The problems of a pydantic validation error, each under the field path a user writes.

    The env section's kind is dropped from the path (``env.max_turns``, not
    ``env.rollout.max_turns``), and a cross-field rule's message that starts with its field
    (``objective: belongs to ...``) is filed under that field.
    """
    problems = []
    for error in exc.errors():
        loc = [str(part) for part in error["loc"]]
        if len(loc) > 1 and loc[0] == "env" and loc[1] in _ENV_TAGS:
            del loc[1]
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = "not a field here: remove it, or fix its spelling"
        elif error["type"] == "value_error":
            message = message.removeprefix("Value error, ")
            named = _FIELD_FIRST.match(message)
            if named:
                loc.append(named.group(1))
                message = named.group(2)
        problems.append(Problem(".".join(loc) or "(top level)", message))
    return problems


def check_run_manifest(manifest: RunManifest, *, build: bool = True) -> list[Problem]:
    """The problems a manifest whose fields are valid would meet as its run starts: missing
    files, rubric functions or imports, a model path that is no model, packages not installed,
    and (with ``build``) an entrypoint env whose constructor fails on its ``env_config``.
    """
    found = _Found()
    env = manifest.env
    if isinstance(env, LLMEnvSpec):
        _llm_env(found, env, manifest.seed, build=build)
    elif isinstance(env, BanditEnvSpec):
        _bandit_env(found, env)
    else:
        _gym_env(found, env, multi_agent=manifest.multi_agent)
    _model(found, manifest.model)
    training = manifest.training
    for is_on, name, package, extra, feature in _TRAINING_PACKAGES:
        if training is not None and is_on(training):
            found.attempt(f"training.{name}", _installed(package, extra, feature))
    return found


def check_eval_config(config: Any) -> list[Problem]:
    """The problems a valid :class:`~agile_llmenvs.config.EvalConfig` would meet as
    ``agile-llmenvs eval`` starts: an unknown reasoning-gym dataset, an entry point that does
    not import, a model path that is no model, a backend's package or API key missing."""
    found = _Found()
    for index, environment in enumerate(config.environments):
        where = f"environments.{index}"
        if environment.source == "reasoning_gym":
            found.attempt(f"{where}.name", _reasoning_gym_dataset(environment.name))
        elif environment.source == "entry_point":
            found.attempt(f"{where}.entry_point", _imports(environment.entry_point))
    _eval_model(found, config.model)
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


# --- reading ----------------------------------------------------------------------------------


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
    from agile_llmenvs.specs import load_manifest

    try:
        manifest = load_manifest(path)
    except ValidationError as exc:
        return Validation(path, "run manifest", problems=tuple(problems_of(exc)))
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
    return " (env not built: it runs on Ray env hosts)" if _hosted(env) else ""


def _hosted(spec: LLMEnvSpec) -> bool:
    return any(f in spec.model_fields_set and getattr(spec, f) for f in HOSTING_FIELDS)


def _validate_eval_config(path: Path, check_files: bool) -> Validation:
    from agile_llmenvs.config import EvalConfig

    try:
        config = EvalConfig.from_yaml(path)
    except ValidationError as exc:
        return Validation(path, "eval config", problems=tuple(problems_of(exc)))
    names = ", ".join(environment.name for environment in config.environments)
    plural = "s" if len(config.environments) > 1 else ""
    summary = (
        f"eval config: {len(config.environments)} environment{plural} ({names}), model "
        f"{config.model.model!r} on {config.model.backend}"
    )
    if not check_files:
        return Validation(path, "eval config", f"{summary} (--no-files: fields only)")
    return Validation(path, "eval config", summary, tuple(check_eval_config(config)))


# --- the checks -------------------------------------------------------------------------------


class _Found(list[Problem]):
    """The problems found so far, and the two ways of finding one."""

    def attempt(
        self, where: str, check: Callable[[], object], section: type[BaseModel] | None = None
    ) -> bool:
        """Run ``check``; what it raises is the problem of ``where``, or of the field of the
        env ``section`` its message starts with (``rubric_name: ...``). True when it passed."""
        try:
            check()
        except Exception as exc:  # a user's module may raise anything while it imports
            text = " ".join(str(exc).split()) or type(exc).__name__
            if not isinstance(exc, AgileLLMEnvsError):  # a foreign error: say which
                text = f"{type(exc).__name__}: {text}"
            named = _FIELD_FIRST.match(text)
            field = named.group(1).removeprefix("env.") if named else ""
            if named and named.group(1) in (where, where.split(".", 1)[-1]):
                self.append(Problem(where, named.group(2)))
            elif named and section is not None and field in section.model_fields:
                self.append(Problem(f"env.{field}", named.group(2)))
            else:
                self.append(Problem(where, text))
            return False
        return True

    def exists(self, where: str, value: str | None) -> bool:
        """Whether the file or folder ``value`` exists (or is unset); a problem if not."""
        if value is None or Path(value).exists():
            return True
        relative = "" if Path(value).is_absolute() else _LOOKED_UP
        self.append(Problem(where, f"{value!r} does not exist{relative}"))
        return False


def _imports(target: str, *, file: str | None = None) -> Callable[[], object]:
    """A check that ``target`` (``module:attr``, or ``file.py:attr`` without ``file``) imports
    a class or function."""

    def check() -> None:
        if file is None:
            from agile_llmenvs.transport.resolve import load_entrypoint

            obj = load_entrypoint(target)
        else:
            from agile_llmenvs._imports import load_object

            obj = load_object(target, file=file)
        if not callable(obj):
            raise ManifestError(f"{target!r} is a {type(obj).__name__}, not a class or function")

    return check


def _installed(package: str, extra: str, feature: str) -> Callable[[], object]:
    module = package.replace("-", "_")

    def check() -> None:
        if importlib.util.find_spec(module) is None:
            raise OptionalDependencyError(package, extra=extra, feature=feature)

    return check


def _llm_env(found: _Found, spec: LLMEnvSpec, seed: int, *, build: bool) -> None:
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
                imported = found.attempt("env.factory", _imports(spec.factory))
            else:
                imported = found.attempt("env.entrypoint", _imports(spec.entrypoint))
            if imported and build and not _hosted(spec):
                found.attempt("env.entrypoint", _one_env_built(spec, seed), LLMEnvSpec)
    if spec.observation_processor is not None:
        found.attempt("env.observation_processor", _imports(spec.observation_processor))
    hosted = [f for f in HOSTING_FIELDS if f in spec.model_fields_set and getattr(spec, f)]
    if hosted and spec.entrypoint is not None:
        found.attempt(f"env.{hosted[0]}", _installed("ray", "ray", "env hosts"))


def _one_env_built(spec: LLMEnvSpec, seed: int) -> Callable[[], object]:
    """A check that one env of an entrypoint spec builds, as training builds it, and closes."""

    def check() -> None:
        from agile_llmenvs.envs.rollout import building
        from agile_llmenvs.transport.resolve import text_env_factory

        make_env = text_env_factory(spec, seed=seed)
        with building(spec):  # the env's own constructor: in training's words
            env = make_env()
        close = getattr(env, "close", None)
        if callable(close):
            close()

    return check


def _rows(found: _Found, spec: LLMEnvSpec, seed: int) -> None:
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


def _gym_env(found: _Found, spec: GymEnvSpec, *, multi_agent: bool) -> None:
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
        found.attempt(f"env.env_wrappers.{index}", _imports(target))


def _gym_builder(found: _Found, spec: GymEnvSpec, *, multi_agent: bool) -> None:
    """What builds the env resolves: the factory, the entrypoint, or the registry id."""
    if spec.factory is not None:
        found.attempt("env.factory", _imports(spec.factory, file=spec.path))
    elif spec.entrypoint is not None:
        found.attempt("env.entrypoint", _imports(spec.entrypoint, file=spec.path))
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


def _bandit_env(found: _Found, spec: BanditEnvSpec) -> None:
    found.exists("env.features", spec.features)
    found.exists("env.targets", spec.targets)
    if found.exists("env.path", spec.path) and spec.entrypoint is not None:
        found.attempt("env.entrypoint", _imports(spec.entrypoint, file=spec.path))


def _model(found: _Found, spec: ModelSpec) -> None:
    """A model path is a local folder whose config and tokenizer (or processor) load offline;
    the built-in model (no path) is built locally when a run starts, so it is not checked."""
    from agile_llmenvs.backends.hf import check_model_dir

    model_found = False
    if spec.path is not None:
        path = spec.path
        model_found = found.attempt("model.path", lambda: check_model_dir(path, field="model.path"))
    tokenizer = spec.tokenizer_path
    tokenizer_found = tokenizer is None or any(
        (Path(tokenizer) / f).is_file() for f in _TOKENIZER_FILES
    )
    if not tokenizer_found:
        found.append(
            Problem(
                "model.tokenizer_path",
                f"{tokenizer!r} is not a tokenizer folder (it holds no {_TOKENIZER_FILES[0]}); "
                "set it to the folder save_pretrained writes, or unset it to use the model's",
            )
        )
    if spec.path is None or not model_found or not (Path(spec.path) / "config.json").is_file():
        return  # no model folder, or LoRA adapters (their base model is named inside)
    model = spec.path
    if found.attempt("model.path", lambda: _config_loads(model)) and tokenizer_found:
        where = "model.tokenizer_path" if tokenizer else "model.path"
        found.attempt(where, lambda: _tokenizer_loads(model, tokenizer))


def _config_loads(path: str) -> None:
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises ValueError, OSError and more
        text = " ".join(str(exc).split())
        if "`model_type`" in text:
            raise ManifestError(
                f"{path!r}: config.json has no model_type: not a transformers model folder; set "
                "model.path to the folder save_pretrained writes (its config.json names a "
                'model_type, e.g. "qwen2")'
            ) from exc
        raise ManifestError(
            f"{path!r}: config.json does not load ({type(exc).__name__}: {text}); set model.path "
            "to the folder save_pretrained writes"
        ) from exc


def _tokenizer_loads(path: str, tokenizer_path: str | None) -> None:
    """The tokenizer training loads loads (the processor, for a vision-language model)."""
    from agile_llmenvs.tiny_vlm import is_vision_model, load_processor

    folder = tokenizer_path or path
    what = "tokenizer"
    fix = (
        f"save it into that folder ({what}.save_pretrained(folder)), or set "
        "model.tokenizer_path to a folder that holds one"
    )
    if not any((Path(folder) / name).is_file() for name in _TOKENIZER_FILES):
        # transformers would make an empty tokenizer of the config's class instead
        raise ManifestError(
            f"{folder!r} holds no tokenizer (no {', '.join(_TOKENIZER_FILES)}); {fix}"
        )
    try:
        if tokenizer_path is None and is_vision_model(path):
            what = "processor"
            load_processor(path)
        else:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError and more
        text = " ".join(str(exc).split())
        fix = fix.replace("tokenizer.save", f"{what}.save")
        raise ManifestError(
            f"{folder!r}: the {what} does not load ({type(exc).__name__}: {text}); {fix}"
        ) from exc


def _reasoning_gym_dataset(name: str) -> Callable[[], object]:
    def check() -> None:
        _installed("reasoning-gym", "envs", f"the reasoning-gym env {name!r}")()
        from reasoning_gym.factory import DATASETS

        if name not in DATASETS:
            close = difflib.get_close_matches(name, list(DATASETS), n=1)
            hint = f"did you mean {close[0]!r}?" if close else "see reasoning_gym.factory.DATASETS"
            raise ManifestError(f"reasoning-gym has no dataset {name!r}; {hint}")

    return check


def _eval_model(found: _Found, model: Any) -> None:
    from agile_llmenvs.backends.hf import check_model_dir
    from agile_llmenvs.config.models import TINY_MODEL, TINY_VLM_MODEL

    if model.backend == "vllm":
        found.attempt("model.backend", _installed("vllm", "vllm", "the vllm backend"))
    if model.backend in ("huggingface", "vllm"):
        if model.model not in (TINY_MODEL, TINY_VLM_MODEL):
            from agile_llmenvs.config.factories import model_directory

            path = model.model  # a training run's folder or checkpoint stands for its model
            found.attempt(
                "model.model",
                lambda: check_model_dir(model_directory(path), field="model.model"),
            )
        return
    sdk = "anthropic" if model.backend == "anthropic" else "openai"
    found.attempt("model.backend", _installed(sdk, "api", f"the {model.backend} backend"))
    variable = model.api_key_env or _API_KEY_ENV[model.backend]
    if model.base_url is None and not os.environ.get(variable):
        found.append(
            Problem(
                "model.api_key_env" if model.api_key_env else "model.backend",
                f"the API key's environment variable {variable} is not set; export it, or "
                "name the variable that holds the key in model.api_key_env",
            )
        )
