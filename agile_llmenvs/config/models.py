"""The evaluation config: environments, model, inference settings, as validated data.

Every model forbids unknown keys, so a typo fails at load with pydantic's
``ValidationError`` naming the field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from agile_llmenvs._yaml import safe_load
from agile_llmenvs.errors import ManifestError
from agile_llmenvs.specs._types import ImportPath

__all__ = [
    "TINY_MODEL",
    "TINY_VLM_MODEL",
    "EnvironmentConfig",
    "EvalConfig",
    "InferenceConfig",
    "ModelConfig",
    "ResultsConfig",
]

#: The ``model`` name that stands for the package's built-in tiny model (built offline).
TINY_MODEL = "tiny"
#: The ``model`` name of the built-in tiny vision-language model (built offline).
TINY_VLM_MODEL = "tiny_vlm"

_STRICT = ConfigDict(extra="forbid", validate_default=True)


class EnvironmentConfig(BaseModel):
    """One environment to evaluate on.

    ``source: reasoning_gym`` (the default) builds ``size`` procedurally generated tasks of
    the reasoning-gym dataset ``name`` (needs the ``envs`` extra); ``source: entry_point``
    imports ``entry_point`` (a ``TextEnv`` class or factory) and calls it with ``env_config``;
    ``source: manifest`` plays the rollout env of the training manifest ``manifest`` (its
    dataset rows and rubric, or its entrypoint), so a trained checkpoint is scored on the
    task it was trained on. At most ``size`` tasks run (fewer when the env has fewer).
    """

    model_config = _STRICT

    name: str = Field(min_length=1, description="Dataset name, or a label for an entry point.")
    source: Literal["reasoning_gym", "entry_point", "manifest"] = "reasoning_gym"
    size: int = Field(100, ge=1, description="How many tasks to build and run (at most).")
    seed: int = Field(
        0, description="Seed of the generated tasks: task i resets its env with seed + i."
    )
    entry_point: ImportPath | None = Field(None, description="'module:attr' of a TextEnv.")
    manifest: str | None = Field(
        None,
        min_length=1,
        description="A training manifest (YAML/JSON) whose rollout env to play, for "
        "source: manifest; a relative path is looked up next to the eval config, then in the "
        "working directory.",
    )
    split: Literal["train", "test"] = Field(
        "train",
        description="source: manifest with dataset rows: the rows trained on, or the held-out "
        "test rows (the manifest's train_test_split, or the dataset's own).",
    )
    env_config: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the dataset or entry point."
    )
    max_steps: int = Field(10, ge=1, description="Most steps per trajectory.")
    pure_step: bool = Field(
        False,
        description=(
            "Declare an entry-point env deterministic given its seed and task, so its states "
            "can be stepped many times and branched for free (reasoning_gym envs always are)."
        ),
    )
    branching_strategy: Literal["direct", "process_fork", "action_replay"] | None = Field(
        None,
        description=(
            "The BranchManager strategy for this env; None picks the first that fits "
            "(direct, process_fork, action_replay)."
        ),
    )

    @model_validator(mode="after")
    def _entry_point_matches_source(self) -> EnvironmentConfig:
        if self.source == "entry_point" and self.entry_point is None:
            raise ValueError("source 'entry_point' needs entry_point: 'package.module:attr'")
        if self.source != "entry_point" and self.entry_point is not None:
            raise ValueError("entry_point is only read with source: entry_point")
        if self.source == "manifest" and self.manifest is None:
            raise ValueError("source 'manifest' needs manifest: path/to/training-manifest.yaml")
        if self.source != "manifest" and self.manifest is not None:
            raise ValueError("manifest is only read with source: manifest")
        return self


class ModelConfig(BaseModel):
    """The model and the backend that serves it.

    API keys are never written in configs: ``api_key_env`` names the environment variable
    holding one (each provider's usual variable by default).
    """

    model_config = ConfigDict(extra="forbid", validate_default=True, protected_namespaces=())

    backend: Literal["huggingface", "vllm", "vllm_server", "openai", "anthropic", "openrouter"]
    model: str = Field(
        min_length=1,
        description=f"Name or local path; {TINY_MODEL!r} and {TINY_VLM_MODEL!r} (a "
        "vision-language model) are built in. A local backend also "
        "takes a training run: its output_dir (the newest complete checkpoint) or one "
        "checkpoint-<step> folder (full weights, or LoRA adapters on their base model). A "
        "relative path is looked up next to the eval config, then in the working directory.",
    )
    base_url: str | None = None
    api_key_env: str | None = None
    max_concurrency: int = Field(64, ge=1, description="API requests in flight at once.")
    max_retries: int = Field(6, ge=0, description="Retries of a 429/5xx API response.")
    timeout_s: float = Field(600.0, gt=0, description="Most seconds per API or server request.")
    urls: list[str] | None = Field(
        None,
        min_length=1,
        description="vllm_server: the base URL of each running `vllm serve` "
        "(http://host:port) serving `model`; `model` is then the local folder whose tokenizer "
        "the servers use.",
    )
    routing: Literal["least_loaded", "round_robin"] = Field(
        "least_loaded", description="vllm_server: how requests are spread over the urls."
    )
    device: str = Field("cpu", description="Torch device of a huggingface backend.")
    dtype: str = "auto"
    hub_kernels: bool = Field(
        False,
        description="huggingface backend: let transformers swap layers for kernels from the "
        "Hugging Face Hub (downloaded on first use by the `kernels` package).",
    )
    max_model_len: int | None = Field(None, ge=1, description="vLLM context length.")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)

    @model_validator(mode="after")
    def _urls_match_backend(self) -> ModelConfig:
        if self.backend == "vllm_server":
            if not self.urls:
                raise ValueError(
                    "backend 'vllm_server' needs urls: [http://host:port, ...], one per "
                    "running `vllm serve`"
                )
            bad = [u for u in self.urls if not u.startswith(("http://", "https://"))]
            if bad:
                raise ValueError(f"urls: {bad[0]!r} is not an http(s) URL; write http://host:port")
        elif self.urls is not None:
            raise ValueError(
                f"urls is only read with backend: vllm_server (this is {self.backend!r})"
            )
        return self

    def api_key(self) -> str | None:
        """The key held by ``api_key_env``, when one is named and set."""
        return os.environ.get(self.api_key_env) if self.api_key_env else None


class InferenceConfig(BaseModel):
    """Sampling settings, shared by every backend."""

    model_config = _STRICT

    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    max_tokens: int = Field(256, ge=1)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None


#: The default cut of texts in a results file (characters per action or message).
MAX_RESULT_TEXT_CHARS = 500


class ResultsConfig(BaseModel):
    """What a results file (``eval --output``) holds for each trajectory."""

    model_config = _STRICT

    max_text_chars: int | None = Field(
        MAX_RESULT_TEXT_CHARS,
        ge=1,
        description="Cut each action and message text to this many characters, marked "
        "'…[+N chars]'; null keeps whole texts.",
    )
    token_ids: bool = Field(
        False, description="Also write each action's sampled token ids (local backends)."
    )


class EvalConfig(BaseModel):
    """A whole evaluation: what to run, with which model, and how to sample."""

    model_config = ConfigDict(extra="forbid", validate_default=True, protected_namespaces=())

    environments: list[EnvironmentConfig] = Field(min_length=1)
    model: ModelConfig
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    batch_size: int | None = Field(None, ge=1, description="Trajectories per lock-step batch.")
    system_prompt: str | None = None
    results: ResultsConfig = Field(default_factory=ResultsConfig)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> EvalConfig:
        """Load and validate a YAML config.

        Relative paths (an environment's ``manifest``, a local ``model``) are looked up
        next to the config first, then in the working directory, as in run manifests.

        Raises:
            ManifestError: The file cannot be read or is not a YAML mapping.
            pydantic.ValidationError: A field is missing, unknown or invalid.
        """
        source = Path(path)
        try:
            data = safe_load(source.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ManifestError(f"cannot read eval config {source}: {exc}") from exc
        except yaml.YAMLError as exc:
            raise ManifestError(f"{source} is not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ManifestError(
                f"{source} must hold a YAML mapping (environments, model, ...), "
                f"got {type(data).__name__}"
            )
        return cls.model_validate(data)._with_paths_from(source.parent)

    def _with_paths_from(self, base: Path) -> EvalConfig:
        """This config with relative paths that exist under ``base`` made to point there."""

        def near(value: str) -> str:
            local = base / value
            return str(local) if not Path(value).is_absolute() and local.exists() else value

        environments = [
            e.model_copy(update={"manifest": near(e.manifest)}) if e.manifest else e
            for e in self.environments
        ]
        model = self.model
        if model.backend in ("huggingface", "vllm", "vllm_server"):
            model = model.model_copy(update={"model": near(model.model)})
        return self.model_copy(update={"environments": environments, "model": model})
