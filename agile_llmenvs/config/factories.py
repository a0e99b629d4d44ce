"""Config to live objects: environments, backends and sampling parameters."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from agile_llmenvs._run_files import CHECKPOINT_MODEL_DIR, CHECKPOINT_NAME, CHECKPOINT_PREFIX
from agile_llmenvs.backends.api import APIConfig, RetryPolicy
from agile_llmenvs.backends.types import Backend, SamplingParams
from agile_llmenvs.config.models import (
    TINY_MODEL,
    TINY_VLM_MODEL,
    EnvironmentConfig,
    InferenceConfig,
    ModelConfig,
)
from agile_llmenvs.core.text_env import TextEnvironment, from_text_env
from agile_llmenvs.errors import BackendError, CheckpointError, EnvBuildError

if TYPE_CHECKING:
    from agile_llmenvs.core import TextEnv

__all__ = [
    "BackendFactory",
    "EnvironmentFactory",
    "create_sampling_params",
    "model_directory",
    "shared_backend",
]


class EnvironmentFactory:
    """Builds the environment an :class:`EnvironmentConfig` describes."""

    @staticmethod
    def create(config: EnvironmentConfig) -> TextEnvironment:
        """A state-passing environment that can run many episodes at once.

        reasoning-gym envs are pure-step (one deterministic scoring step); entry-point and
        manifest envs are when ``config.pure_step`` says so. Branch it with
        ``BranchManager.create(env, strategy=config.branching_strategy)``.

        Raises:
            OptionalDependencyError: The env's source package is not installed.
            EnvBuildError: The source cannot build the env (a manifest without a rollout
                env of dataset rows or an entrypoint, say).
            ImportPathError: ``entry_point`` does not resolve.
        """
        if config.source == "reasoning_gym":
            from agile_llmenvs.adapters.reasoning_gym import reasoning_gym_factory

            factory = reasoning_gym_factory(
                config.name, size=config.size, seed=config.seed, **config.env_config
            )
            return from_text_env(factory, name=config.name, pure_step=True)
        if config.source == "manifest":
            assert config.manifest is not None  # the model validator guarantees it
            make = _manifest_env_factory(config.manifest, config.split)
            return from_text_env(make, name=config.name, pure_step=config.pure_step)
        from agile_llmenvs._imports import load_object

        assert config.entry_point is not None  # the model validator guarantees it
        target = load_object(config.entry_point)
        kwargs = dict(config.env_config)
        return from_text_env(lambda: target(**kwargs), name=config.name, pure_step=config.pure_step)


class BackendFactory:
    """Builds the backend a :class:`ModelConfig` describes."""

    @staticmethod
    def create(config: ModelConfig) -> Backend:
        """A backend serving ``config.model``.

        ``model: tiny`` with a local backend is the package's tiny model, built offline
        into its cache on first use.

        Raises:
            OptionalDependencyError: The backend's package (vllm, openai, anthropic) is
                not installed.
            BackendError: An API backend has no key.
        """
        if config.backend in ("huggingface", "vllm"):
            return _local_backend(config)
        if config.backend == "vllm_server":
            return _server_backend(config)
        from agile_llmenvs.backends.anthropic_api import AnthropicBackend
        from agile_llmenvs.backends.openai_api import OpenAIBackend, OpenRouterBackend

        classes: dict[str, Any] = {
            "openai": OpenAIBackend,
            "anthropic": AnthropicBackend,
            "openrouter": OpenRouterBackend,
        }
        api_config = APIConfig(
            timeout_s=config.timeout_s, retry=RetryPolicy(max_retries=config.max_retries)
        )
        backend: Backend = classes[config.backend](
            config.model,
            base_url=config.base_url,
            api_key=config.api_key(),
            max_concurrency=config.max_concurrency,
            config=api_config,
        )
        return backend


def _manifest_env_factory(path: str, split: Literal["train", "test"]) -> Callable[[], TextEnv]:
    """Fresh text envs of the rollout env a training manifest declares, as it trains on it."""
    from agile_llmenvs.specs import LLMEnvSpec, load_manifest

    try:
        manifest = load_manifest(path)
    except FileNotFoundError as exc:
        raise EnvBuildError(f"manifest: {path!r} does not exist") from exc
    spec = manifest.env
    if not isinstance(spec, LLMEnvSpec) or spec.env_type != "rollout":
        raise EnvBuildError(
            f"manifest: {path} declares a {spec.env_type} env; evaluation plays rollout envs "
            "(env_type: rollout, with dataset rows and a rubric, or an entrypoint)"
        )
    if spec.source not in ("dataset", "entrypoint"):
        raise EnvBuildError(
            f"manifest: {path} plays a served env ({spec.source}); evaluate it with "
            "source: entry_point, or give the manifest dataset rows or an entrypoint"
        )
    from agile_llmenvs.llm_envs.from_spec import text_env_factory

    # the rows of the split training made (its seed), or the entrypoint env as it trains
    return text_env_factory(spec, seed=manifest.seed or 0, split=split)


def model_directory(model: str) -> str:
    """The model folder a local backend loads for ``model``.

    ``tiny`` and ``tiny_vlm`` are the built-in models (built offline on first use). A
    training run's ``output_dir`` (it holds ``checkpoint-<step>`` folders) stands for its
    newest complete checkpoint, and a ``checkpoint-<step>`` folder for the model it saved
    (its ``model/``: full weights, or a LoRA run's adapters); anything else is returned as it
    is (a model folder, or a hub name).

    Raises:
        CheckpointError: ``model`` is a run folder with no complete checkpoint.
    """
    if model == TINY_MODEL:
        from agile_llmenvs.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model())
    if model == TINY_VLM_MODEL:
        from agile_llmenvs.tiny_vlm import ensure_tiny_vlm

        return str(ensure_tiny_vlm())
    folder = Path(model)
    if CHECKPOINT_NAME.match(folder.name) and (folder / CHECKPOINT_MODEL_DIR).is_dir():
        return str(folder / CHECKPOINT_MODEL_DIR)
    if folder.is_dir() and any(p.name.startswith(CHECKPOINT_PREFIX) for p in folder.iterdir()):
        from agile_llmenvs.weights import find_checkpoint

        found = find_checkpoint(folder)
        if found is None:
            raise CheckpointError(
                f"model: the run folder {model} has no complete checkpoint (only partial or "
                "damaged ones); name a checkpoint-<step> folder, or train until one is saved"
            )
        return str(found.directory / CHECKPOINT_MODEL_DIR)
    return model


def _local_backend(config: ModelConfig) -> Backend:
    model_path = model_directory(config.model)
    from agile_llmenvs.backends.hf import check_model_dir

    check_model_dir(model_path, field="model.model")
    if config.backend == "huggingface":
        from agile_llmenvs.backends.hf import HFBackend, HFConfig

        hf = HFConfig(device=config.device, dtype=config.dtype, hub_kernels=config.hub_kernels)
        return HFBackend(model_path, config=hf)
    from agile_llmenvs.backends.vllm import VLLMBackend, VLLMConfig

    if (Path(model_path) / "adapter_config.json").is_file():
        raise BackendError(
            f"model: {model_path} holds LoRA adapters, and the vllm backend loads whole models; "
            "evaluate it with backend: huggingface (which merges them into the base model)"
        )
    vllm_config = VLLMConfig(
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        gpu_memory_utilization=config.gpu_memory_utilization,
    )
    return VLLMBackend(model_path, config=vllm_config)


def _server_backend(config: ModelConfig) -> Backend:
    """A :class:`~agile_llmenvs.backends.VLLMServerBackend` over ``config.urls``, with the
    tokenizer of the local model folder ``config.model``."""
    from agile_llmenvs.backends.hf import check_model_dir
    from agile_llmenvs.backends.vllm_server import VLLMServerBackend

    model_path = model_directory(config.model)
    check_model_dir(model_path, field="model.model")
    assert config.urls  # the model validator guarantees it
    return VLLMServerBackend(
        config.urls, tokenizer=model_path, routing=config.routing, timeout_s=config.timeout_s
    )


def create_sampling_params(config: InferenceConfig) -> SamplingParams:
    """The :class:`SamplingParams` of an inference config."""
    return SamplingParams(
        max_tokens=config.max_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        stop=tuple(config.stop),
        seed=config.seed,
    )


_SHARED_BACKENDS: dict[str, tuple[Backend, threading.Lock]] = {}
_SHARED_LOCK = threading.Lock()


def shared_backend(config: Mapping[str, Any], field: str) -> tuple[Backend, threading.Lock]:
    """The backend a :class:`ModelConfig` mapping describes, built once per process and
    config, with a lock its callers share: every rollout slot's env builds its conversation
    partner or opponent, and a local model is loaded only once.

    Args:
        config: :class:`ModelConfig`'s fields.
        field: Where the config came from, for the error (``"dialogue: env_config.partner"``).

    Raises:
        EnvBuildError: ``config`` is not a valid :class:`ModelConfig`, naming ``field``.
    """
    key = json.dumps(dict(config), sort_keys=True, default=str)
    with _SHARED_LOCK:
        if key not in _SHARED_BACKENDS:
            try:
                model_config = ModelConfig(**config)
            except ValueError as exc:
                raise EnvBuildError(f"{field}: {exc}") from exc
            _SHARED_BACKENDS[key] = (BackendFactory.create(model_config), threading.Lock())
        return _SHARED_BACKENDS[key]
