"""Build a RolloutHarness from a URL, an entrypoint string, or an LLMEnvSpec."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agile_llmenvs._imports import load_object
from agile_llmenvs.errors import EnvBuildError
from agile_llmenvs.specs import LLMEnvSpec
from agile_llmenvs.transport.client import InProcessEnvClient
from agile_llmenvs.transport.resolve import ensure_env_packages, env_factory

if TYPE_CHECKING:
    from agile_llmenvs.llm_envs.harness import RolloutHarness

__all__ = ["harness_from_spec", "spec_settings"]

_URL_SCHEMES = ("http://", "https://", "ws://", "wss://")


def spec_settings(spec: LLMEnvSpec) -> dict[str, Any]:
    """The harness settings a spec declares (unset fields are left to the defaults)."""
    settings: dict[str, Any] = {
        "max_turns": spec.max_turns,
        "timeout_s": spec.request_timeout_s or None,
        "mcp_tool": spec.mcp_tool,
        "tool_call_parser": spec.tool_call_parser,
        "strip_reasoning": spec.strip_reasoning,
        "reasoning_delimiters": spec.reasoning_delimiters,
        "action_field": spec.action_field,
        "observation_field": spec.observation_field,
        "observation_processor": (
            load_object(spec.observation_processor) if spec.observation_processor else None
        ),
        "strict_chat_template_boundary": spec.strict_chat_template_boundary,
        "apply_chat_template": spec.apply_chat_template,
        "chat_template_kwargs": spec.chat_template_kwargs or None,
        "segment_prompt_tokens": spec.segment_prompt_tokens,
        "segment_max_images": spec.segment_max_images,
        "restart_keep_turns": spec.restart_keep_turns,
        "action_error_field": spec.action_error_field,
    }
    return {key: value for key, value in settings.items() if value is not None}


def harness_from_spec(
    cls: type[RolloutHarness],
    spec: LLMEnvSpec | str,
    tokenizer: Any,
    *,
    allow_install: bool = False,
    **settings: Any,
) -> RolloutHarness:
    """Build one harness: a URL is reached over a WebSocket session, an entrypoint is built
    in this process. Explicit ``settings`` override what the spec declares.

    Raises:
        EnvBuildError: the spec's source cannot be built here (a dataset-backed env, which
            :func:`~agile_llmenvs.envs.make_rollout_env_factory` builds, or an ``env_image``).
    """
    if isinstance(spec, str):
        if spec.startswith(_URL_SCHEMES):
            return cls(spec, tokenizer, **settings)
        return cls.local(env_factory(spec)(), tokenizer, **settings)
    if spec.env_type != "rollout":
        raise EnvBuildError(f"{spec.label!r} is a dataset env; a harness needs env_type rollout")
    merged = {**spec_settings(spec), **settings}
    max_turns = merged.pop("max_turns", None)
    if spec.source == "env_url":
        return cls(spec.env_urls[0], tokenizer, max_turns or 1, **merged)
    if spec.source == "entrypoint":
        assert spec.entrypoint is not None
        ensure_env_packages(spec.env_packages, allow_install=allow_install)
        env = env_factory(spec.entrypoint, spec.env_config, factory=spec.factory)()
        client = InProcessEnvClient(env, action_field=merged.get("action_field", "message"))
        return cls(client, tokenizer, max_turns or int(getattr(env, "max_turns", 1)), **merged)
    raise EnvBuildError(
        f"{spec.label!r}: a {spec.source} rollout env is built by make_rollout_env_factory"
        + (" on the Ray runtime" if spec.source == "env_image" else "")
    )
