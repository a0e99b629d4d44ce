"""The run manifest: env + model + training settings + seed, loaded from YAML or JSON."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, model_validator

from agile_llmenvs._imports import add_import_folder, module_file
from agile_llmenvs._yaml import safe_load
from agile_llmenvs.errors import ManifestError
from agile_llmenvs.specs._types import SPEC_CONFIG
from agile_llmenvs.specs.env import BanditEnvSpec, GymEnvSpec, OfflineEnvSpec, fail
from agile_llmenvs.specs.generation import VLLMGenerationSpec, VLLMServerSpec
from agile_llmenvs.specs.llm import LLMEnvSpec
from agile_llmenvs.specs.training import LoRASpec, TrainingSpec

__all__ = [
    "MAX_MANIFEST_BYTES",
    "EnvSpec",
    "LoRASpec",
    "ModelSpec",
    "RunManifest",
    "TrainingSpec",
    "VLLMGenerationSpec",
    "VLLMServerSpec",
    "absolute_paths",
    "dump_manifest",
    "load_manifest",
    "manifest_json_schema",
    "size_refusal",
]

#: The largest manifest file :func:`load_manifest` reads: it is settings, not data (a run's data
#: lives in the files its manifest names), and a many-megabyte document costs seconds and
#: hundreds of megabytes to parse before anything can be said about it.
MAX_MANIFEST_BYTES = 1024 * 1024

EnvSpec = Annotated[
    GymEnvSpec | OfflineEnvSpec | LLMEnvSpec | BanditEnvSpec,
    Field(discriminator="env_type"),
]
"""Any env section, told apart by ``env_type``: gym, offline, rollout, dataset or bandit."""

# Files a run reads, by section: looked up next to the manifest file before the working dir.
_PATH_FIELDS: dict[type[BaseModel], tuple[str, ...]] = {
    GymEnvSpec: ("path", "env_config"),
    OfflineEnvSpec: ("path", "env_config", "dataset_path"),
    BanditEnvSpec: ("path", "features", "targets"),
    LLMEnvSpec: ("dataset_path", "rubric_file_path", "chat_template_path"),
}
_MODEL_PATH_FIELDS = ("path", "tokenizer_path")
_ALGORITHM_ENV: dict[str, tuple[str, str | None]] = {
    "grpo": ("rollout", None),
    "sft": ("dataset", "sft"),
    "dpo": ("dataset", "preference"),
}


class ModelSpec(BaseModel):
    """The policy model: a local checkpoint directory, or the built-in tiny model."""

    model_config = SPEC_CONFIG

    path: str | None = Field(
        None,
        min_length=1,
        description="Local model directory (Hugging Face layout). Unset: the built-in model "
        "`builtin` names, built offline on first use.",
    )
    builtin: Literal["tiny", "tiny_vlm"] = Field(
        "tiny",
        description="The built-in model used when `path` is unset: `tiny` (a text model) or "
        "`tiny_vlm` (a Qwen2-VL-style vision-language model that reads images).",
    )
    tokenizer_path: str | None = Field(
        None, min_length=1, description="Tokenizer directory, if not the model's."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype the model is loaded in."
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Context length prompts are truncated to."
    )
    hub_kernels: bool = Field(
        False,
        description="Let transformers swap layers for kernels from the Hugging Face Hub (the "
        "`kernels` package, which downloads them on first use; transformers' own default when "
        "`kernels` is installed). Off: the model's own torch code, no download, and no "
        "re-kernelization at each switch between generation and training.",
    )


class RunManifest(BaseModel):
    """One run: the env to build, the model, the training settings and the seed."""

    model_config = SPEC_CONFIG

    name: str | None = Field(None, min_length=1, description="Name of the run.")
    env: EnvSpec = Field(description="The environment section; `env_type` picks its kind.")
    multi_agent: bool = Field(
        False, description="Build a `gym` env as a vectorised PettingZoo parallel env."
    )
    model: ModelSpec = Field(default_factory=ModelSpec, description="The policy model.")
    training: TrainingSpec | None = Field(
        None, description="Training settings; unset for a manifest used only to build envs."
    )
    seed: int = Field(0, ge=0, description="Seed of every random draw of the run.")

    @model_validator(mode="after")
    def _check_pairing(self) -> RunManifest:
        if self.multi_agent and not isinstance(self.env, GymEnvSpec):
            raise fail(
                "multi_agent", f"PettingZoo envs use env_type 'gym', not {self.env.env_type!r}"
            )
        if self.training is None:
            return self
        if self.model.dtype != "float32" and self.training.lora is None:
            raise fail(
                "model.dtype",
                f"training {self.model.dtype} weights: AdamW rounds most updates away. Set "
                "`model.dtype: float32` and `training.mixed_precision: bf16` (fp32 master "
                "weights, bf16 compute), or train LoRA adapters (`training.lora`)",
            )
        env_type, objective = _ALGORITHM_ENV[self.training.algorithm]
        actual = (self.env.env_type, getattr(self.env, "objective", None))
        if actual[0] != env_type or (objective is not None and actual[1] != objective):
            want = f"env_type {env_type!r}" + (
                f" with objective {objective!r}" if objective else ""
            )
            raise fail(
                "training.algorithm",
                f"{self.training.algorithm!r} trains on an env of "
                f"{want}; this env has env_type {actual[0]!r}",
            )
        backend = self.training.generation_backend
        if self.model.path is None and self.model.builtin == "tiny_vlm" and backend != "hf":
            raise fail(
                "training.generation_backend",
                f"{backend!r} generates from ids alone, but `model.builtin: tiny_vlm` is a "
                "vision-language model: use `generation_backend: hf`",
            )
        return self


def load_manifest(path: str | Path) -> RunManifest:
    """Read a run manifest from a ``.yaml``/``.yml`` or ``.json`` file.

    A relative path in the manifest is relative to the manifest's folder: the files a run
    reads (data, rubric, env source, a rollout ``entrypoint``'s ``file.py``, ``model.path``)
    are looked up there first, then in the working directory; a relative
    ``training.output_dir`` is always there. A ``module:attr`` (entrypoint, factory, wrapper,
    processor) whose module Python cannot find is imported from the manifest's folder, then
    from the working directory (``sys.path`` is left as it is).

    Raises:
        FileNotFoundError: the file does not exist.
        ManifestError: the file is larger than :data:`MAX_MANIFEST_BYTES` (refused before it
            is read), not valid YAML/JSON, or has another extension.
        pydantic.ValidationError: the content breaks a rule; the error names the field.
    """
    path = Path(path)
    refusal = size_refusal(path)
    if refusal is not None:
        raise ManifestError(f"{path}: {refusal}")
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            data = safe_load(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ManifestError(f"{path}: expected a .yaml, .yml or .json manifest, got {suffix!r}")
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path}: not valid {suffix[1:].upper()}: {exc}") from exc
    manifest = RunManifest.model_validate(data)
    add_import_folder(path.parent)
    return _resolve_relative_paths(manifest, path.parent)


def size_refusal(path: Path) -> str | None:
    """Why the file at ``path`` is refused unread: it is larger than
    :data:`MAX_MANIFEST_BYTES` (None when it is not)."""
    size = path.stat().st_size
    if size <= MAX_MANIFEST_BYTES:
        return None
    return (
        f"the manifest is {size:,} bytes, more than the limit of {MAX_MANIFEST_BYTES:,} "
        "(MAX_MANIFEST_BYTES); keep data out of it, in a file it names (a dataset_path, an "
        "env_config file)"
    )


def dump_manifest(manifest: RunManifest, path: str | Path) -> None:
    """Write ``manifest`` as YAML or JSON (by extension); :func:`load_manifest` reads it back."""
    path = Path(path)
    data = manifest.model_dump(mode="json", exclude_unset=True)
    if path.suffix.lower() == ".json":
        path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    else:
        path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")


def manifest_json_schema() -> dict[str, Any]:
    """The JSON Schema of :class:`RunManifest`, for editor autocompletion of manifests."""
    schema = RunManifest.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "agile_llmenvs run manifest"
    return schema


def absolute_paths(manifest: RunManifest) -> RunManifest:
    """``manifest`` with its relative paths made absolute against the working directory, the
    way a run opens them: each file it reads that exists there, and ``training.output_dir``.
    A rollout ``entrypoint: module:attr`` whose module is a file imported from a manifest's
    folder (not found on ``sys.path``) becomes that file's absolute ``path.py:attr``.

    A run stores its manifest so (see :mod:`agile_llmenvs.training.run.folder`), and compares
    a resumed run's by the files they name, not by how each spelled them.
    """

    def input_path(value: str) -> str | None:
        return str(Path(value).resolve()) if Path(value).exists() else None

    pinned = _map_paths(manifest, input_path, lambda value: str(Path(value).resolve()))
    env = pinned.env
    if not isinstance(env, LLMEnvSpec) or env.entrypoint is None or env.factory is not None:
        return pinned
    module, _, attr = env.entrypoint.partition(":")
    found = module_file(module) if attr else None
    if found is None:
        return pinned
    # a module found beside a manifest, not on sys.path: its file, which a run folder's
    # manifest (elsewhere) still finds
    update = {"entrypoint": f"{found}:{attr}"}
    return pinned.model_copy(update={"env": env.model_copy(update=update)})


def _resolve_relative_paths(manifest: RunManifest, base: Path) -> RunManifest:
    """The manifest file's rule: a relative path is relative to ``base``, its folder (a file
    to read that is not there is left for the working directory)."""

    def input_path(value: str) -> str | None:
        return str(base / value) if (base / value).exists() else None

    return _map_paths(manifest, input_path, lambda value: str(base / value))


def _map_paths(
    manifest: RunManifest,
    input_path: Callable[[str], str | None],
    output_path: Callable[[str], str],
) -> RunManifest:
    """Rewrite each relative path field: the files a run reads with ``input_path`` (``None``
    keeps the value), ``training.output_dir`` and ``training.vllm_server.weights_dir`` with
    ``output_path``."""

    def rewritten(section: BaseModel, fields: tuple[str, ...]) -> dict[str, str]:
        updates = {}
        for field in fields:
            value = getattr(section, field)
            if isinstance(value, str) and not Path(value).is_absolute():
                new = input_path(value)
                if new is not None:
                    updates[field] = new
        return updates

    updates: dict[str, Any] = {}
    env_paths = rewritten(manifest.env, _PATH_FIELDS[type(manifest.env)])
    for field in _FILE_ATTR_FIELDS:  # `file.py:attr` names a file too
        file_attr = _relative_file_attr(manifest.env, field)
        if file_attr is not None and (new_file := input_path(file_attr[0])) is not None:
            env_paths[field] = f"{new_file}:{file_attr[1]}"
    if env_paths:
        updates["env"] = manifest.env.model_copy(update=env_paths)
    model_paths = rewritten(manifest.model, _MODEL_PATH_FIELDS)
    if model_paths:
        updates["model"] = manifest.model.model_copy(update=model_paths)
    training = manifest.training
    if training is not None:
        training_paths: dict[str, Any] = {}
        if training.output_dir and not Path(training.output_dir).is_absolute():
            training_paths["output_dir"] = output_path(training.output_dir)
        server = training.vllm_server
        if server is not None and server.weights_dir and not Path(server.weights_dir).is_absolute():
            weights_dir = output_path(server.weights_dir)
            training_paths["vllm_server"] = server.model_copy(update={"weights_dir": weights_dir})
        if training_paths:
            updates["training"] = training.model_copy(update=training_paths)
    return manifest.model_copy(update=updates) if updates else manifest


#: The rollout env's fields that may name ``path/to/file.py:attr``.
_FILE_ATTR_FIELDS = ("entrypoint", "action_parser")


def _relative_file_attr(env: BaseModel, field: str) -> tuple[str, str] | None:
    """The relative file and attribute of a rollout env's ``field: file.py:attr``, if so."""
    value = getattr(env, field, None) if isinstance(env, LLMEnvSpec) else None
    file, sep, attr = (value or "").rpartition(":")
    if sep and file.endswith(".py") and not Path(file).is_absolute():
        return file, attr
    return None
