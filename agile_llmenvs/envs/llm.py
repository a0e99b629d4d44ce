"""LLM env builders: their place in the public API, filled by the dataset and rollout work."""

from __future__ import annotations

from typing import Any

from agile_llmenvs.errors import AgileLLMEnvsError
from agile_llmenvs.specs import LLMEnvSpec

__all__ = ["make_llm_env", "make_rollout_env_factory"]


def make_llm_env(spec: LLMEnvSpec, tokenizer: Any, **kwargs: Any) -> Any:
    """Build the teacher-forced ``DatasetEnv`` of a dataset spec (not available yet)."""
    raise NotImplementedError(
        f"make_llm_env({spec.label!r}): dataset envs are not built by this version yet"
    )


def make_rollout_env_factory(spec: LLMEnvSpec, tokenizer: Any, **kwargs: Any) -> Any:
    """Build the ``RolloutHarness`` factory of a rollout spec (not available yet)."""
    raise NotImplementedError(
        f"make_rollout_env_factory({spec.label!r}): rollout envs are not built by this version yet"
    )


def rollout_env_error(spec: LLMEnvSpec) -> AgileLLMEnvsError:
    """The error :func:`make_env` raises for a rollout spec, which has no single live env."""
    return AgileLLMEnvsError(
        f"{spec.label!r} is a rollout env: each trajectory gets its own env, so build a "
        "factory with make_rollout_env_factory(spec, tokenizer) instead of make_env"
    )
