"""What an LLMEnvSpec (or a URL, or an entrypoint string) builds: the arguments of its
RolloutHarness, a factory of its text envs, and the turn budget of an env the manifest gives
none."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from agile_llmenvs._imports import load_object
from agile_llmenvs.core import TextEnv
from agile_llmenvs.errors import EnvBuildError
from agile_llmenvs.specs import LLMEnvSpec
from agile_llmenvs.transport._openenv import Environment
from agile_llmenvs.transport.client import EnvClientProtocol, InProcessEnvClient
from agile_llmenvs.transport.remote import RemoteEnvClient
from agile_llmenvs.transport.resolve import ensure_env_packages, env_factory, load_entrypoint

__all__ = [
    "env_turn_budget",
    "harness_arguments",
    "served_turn_budget",
    "spec_settings",
    "text_env_factory",
    "unknown_turn_budget",
]

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
        "max_observation_bytes": spec.max_observation_bytes,
        "segment_prompt_tokens": spec.segment_prompt_tokens,
        "segment_max_images": spec.segment_max_images,
        "image_field": spec.image_field,
        "restart_keep_turns": spec.restart_keep_turns,
        "action_error_field": spec.action_error_field,
        "invalid_action_reward": spec.invalid_action_reward,
        "action_parser": (
            load_entrypoint(spec.action_parser, field="env.action_parser")
            if spec.action_parser
            else None
        ),
    }
    return {key: value for key, value in settings.items() if value is not None}


def served_turn_budget(url: str, *, timeout_s: float | None = None) -> int:
    """The turn budget the env served at ``url`` advertises: ``max_turns`` in its state.

    Raises:
        EnvBuildError: the state has no ``max_turns`` (OpenEnv's own ``State`` has none), so
            the manifest must set ``env.max_turns``.
    """
    with RemoteEnvClient(url, timeout_s=timeout_s) as client:
        client.reset()  # a session opens on its first reset
        value = client.state().get("max_turns")
    if not value:
        raise unknown_turn_budget(f"the env at {url}")
    return int(value)


def env_turn_budget(env: Any, *, label: str) -> int:
    """The turn budget an env built in this process declares.

    A ``max_turns`` attribute is the budget. An OpenEnv ``Environment`` without one is asked
    as a served env would be: ``max_turns`` in its state after a reset. A text env that
    declares none is single-turn (1), as the ``TextEnv`` contract has it.

    Raises:
        EnvBuildError: an OpenEnv ``Environment`` advertises no budget (name it in
            ``env.max_turns``); ``label`` names the env in the message.
    """
    declared = getattr(env, "max_turns", None)
    if declared:
        return int(declared)
    if not isinstance(env, Environment):
        return 1
    env.reset()
    value = getattr(env.state, "max_turns", None)
    if not value:
        raise unknown_turn_budget(f"the OpenEnv env {label!r}")
    return int(value)


def unknown_turn_budget(where: str) -> EnvBuildError:
    """The error for an env whose turn budget is unknown (``where`` names the env)."""
    return EnvBuildError(
        f"env.max_turns: {where} does not advertise a turn budget (its state has no "
        "`max_turns`), so an episode's length is unknown; set `max_turns` in the manifest's "
        "env section to the turns an episode may take (e.g. `max_turns: 3`)"
    )


def text_env_factory(
    spec: LLMEnvSpec,
    *,
    seed: int = 0,
    split: Literal["train", "test"] = "train",
    allow_install: bool = False,
) -> Callable[[], TextEnv]:
    """A zero-argument callable building a fresh text env of a rollout spec per call: what a
    server hosts for it, and what an eval of a training manifest plays.

    An ``entrypoint`` env is built as :func:`~agile_llmenvs.transport.resolve.env_factory`
    builds it (after its ``env_packages`` are checked); a dataset-backed env is a single-turn
    :class:`~agile_llmenvs.llm_envs.rubric.RubricEnv` over the ``split`` rows (split by
    ``seed``, as training splits them), scored by the spec's rubric.

    Raises:
        EnvBuildError: the spec is not a rollout env of one of those sources (an ``env_url``
            is hosted already; an ``env_image`` runs as its own Pod), its rows or rubric
            cannot be loaded, the split has no rows, or its ``env_packages`` are missing.
        ImportPathError: the entrypoint or factory does not resolve.
    """
    if spec.env_type != "rollout":
        raise EnvBuildError(
            f"env.env_type: {spec.label!r} is a dataset env (teacher-forced rows); only rollout "
            "envs have episodes to host"
        )
    if spec.source == "entrypoint":
        assert spec.entrypoint is not None  # the source says so
        ensure_env_packages(spec.env_packages, allow_install=allow_install)
        return env_factory(spec.entrypoint, spec.env_config, factory=spec.factory)
    if spec.source == "dataset":
        from agile_llmenvs.llm_envs.rows import load_rows
        from agile_llmenvs.llm_envs.rubric import RubricEnv, load_rubric

        assert spec.rubric_file_path is not None  # the spec guarantees a rubric with rows
        rubric = load_rubric(spec.rubric_file_path, spec.rubric_name)
        train, test = load_rows(spec, seed)
        rows = (train if split == "train" else test).to_list()
        if not rows:
            raise EnvBuildError(f"env: {spec.label!r} has no {split} rows to play")
        template, max_reward = spec.prompt_template, spec.max_reward
        return lambda: RubricEnv(rows, rubric, prompt_template=template, max_reward=max_reward)
    where = (
        f"is already hosted at {', '.join(spec.env_urls)}"
        if spec.source == "env_url"
        else f"{spec.env_image!r} runs as its own Pod, placed by the Ray runtime"
    )
    raise EnvBuildError(
        f"env.{spec.source}: this env {where}; hosting needs an `entrypoint` or dataset rows "
        "with a rubric"
    )


def harness_arguments(
    spec: LLMEnvSpec | str, *, allow_install: bool = False, **settings: Any
) -> tuple[str | EnvClientProtocol, int, dict[str, Any]]:
    """The ``(env_client, max_turns, settings)`` of one harness
    (:meth:`RolloutHarness.from_spec <agile_llmenvs.llm_envs.harness.RolloutHarness.from_spec>`
    builds it from them): a URL is reached over a WebSocket session, an entrypoint is built
    in this process. Explicit ``settings`` override what the spec declares; without a
    ``max_turns`` in either, the env's own budget is used (:func:`served_turn_budget`,
    :func:`env_turn_budget`).

    Raises:
        EnvBuildError: the spec's source cannot be built here (a dataset-backed env, which
            :func:`~agile_llmenvs.envs.make_rollout_env_factory` builds, or an ``env_image``),
            or the env advertises no turn budget and none is given.
    """
    if isinstance(spec, str):
        source = "env_url" if spec.startswith(_URL_SCHEMES) else "entrypoint"
        spec = LLMEnvSpec.model_validate({"env_type": "rollout", source: spec})
    if spec.env_type != "rollout":
        raise EnvBuildError(f"{spec.label!r} is a dataset env; a harness needs env_type rollout")
    merged = {**spec_settings(spec), **settings}
    max_turns = merged.pop("max_turns", None)
    if spec.source == "env_url":
        url = spec.env_urls[0]
        max_turns = max_turns or served_turn_budget(url, timeout_s=merged.get("timeout_s"))
        return url, max_turns, merged
    if spec.source == "entrypoint":
        assert spec.entrypoint is not None
        ensure_env_packages(spec.env_packages, allow_install=allow_install)
        env = env_factory(spec.entrypoint, spec.env_config, factory=spec.factory)()
        max_turns = max_turns or env_turn_budget(env, label=spec.entrypoint)
        client = InProcessEnvClient(env, action_field=merged.get("action_field", "message"))
        return client, max_turns, merged
    raise EnvBuildError(
        f"{spec.label!r}: a {spec.source} rollout env is built by make_rollout_env_factory"
        + (" on the Ray runtime" if spec.source == "env_image" else "")
    )
