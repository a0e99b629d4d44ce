"""Config to live objects: environments, backends and sampling parameters."""

from __future__ import annotations

from typing import Any

from agile_llmenvs.backends.api import APIConfig, RetryPolicy
from agile_llmenvs.backends.types import Backend, SamplingParams
from agile_llmenvs.config.models import TINY_MODEL, EnvironmentConfig, InferenceConfig, ModelConfig
from agile_llmenvs.core.text_env import TextEnvironment, from_text_env

__all__ = ["BackendFactory", "EnvironmentFactory", "create_sampling_params"]


class EnvironmentFactory:
    """Builds the environment an :class:`EnvironmentConfig` describes."""

    @staticmethod
    def create(config: EnvironmentConfig) -> TextEnvironment:
        """A state-passing environment that can run many episodes at once.

        reasoning-gym envs are pure-step (one deterministic scoring step); an entry-point
        env is when ``config.pure_step`` says so. Branch it with
        ``BranchManager.create(env, strategy=config.branching_strategy)``.

        Raises:
            OptionalDependencyError: The env's source package is not installed.
            EnvBuildError: The source cannot build the env.
            ImportPathError: ``entry_point`` does not resolve.
        """
        if config.source == "reasoning_gym":
            from agile_llmenvs.adapters.reasoning_gym import reasoning_gym_factory

            factory = reasoning_gym_factory(
                config.name, size=config.size, seed=config.seed, **config.env_config
            )
            return from_text_env(factory, name=config.name, pure_step=True)
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


def _local_backend(config: ModelConfig) -> Backend:
    model_path: str = config.model
    if model_path == TINY_MODEL:
        from agile_llmenvs.tiny_model import ensure_tiny_model

        model_path = str(ensure_tiny_model())
    if config.backend == "huggingface":
        from agile_llmenvs.backends.hf import HFBackend, HFConfig

        return HFBackend(model_path, config=HFConfig(device=config.device, dtype=config.dtype))
    from agile_llmenvs.backends.vllm import VLLMBackend, VLLMConfig

    vllm_config = VLLMConfig(
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        gpu_memory_utilization=config.gpu_memory_utilization,
    )
    return VLLMBackend(model_path, config=vllm_config)


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
