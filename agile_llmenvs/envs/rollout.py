"""make_rollout_env_factory: a rollout spec -> a factory of fresh RolloutHarness instances."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from agile_llmenvs.errors import AgileLLMEnvsError, EnvBuildError
from agile_llmenvs.llm_envs.from_spec import env_turn_budget, served_turn_budget, spec_settings
from agile_llmenvs.llm_envs.harness import RolloutHarness
from agile_llmenvs.llm_envs.rubric import RubricEnv, load_rubric
from agile_llmenvs.specs import LLMEnvSpec
from agile_llmenvs.specs.llm import HOSTING_FIELDS
from agile_llmenvs.transport.client import InProcessEnvClient
from agile_llmenvs.transport.protocol import exception_location
from agile_llmenvs.transport.remote import RemoteEnvClient
from agile_llmenvs.transport.resolve import ensure_env_packages, env_factory

__all__ = ["building", "env_build_error", "make_rollout_env_factory"]

HarnessFactory = Callable[[], RolloutHarness]


def make_rollout_env_factory(
    spec: LLMEnvSpec,
    tokenizer: Any,
    *,
    max_model_len: int | None = None,
    max_output_tokens: int | None = None,
    seed: int | None = None,
    allow_install: bool = False,
    split: Literal["train", "test"] = "train",
    vision_processor: Any = None,
) -> tuple[HarnessFactory, int]:
    """Build a factory that creates fresh :class:`RolloutHarness` instances.

    Each call builds an independent env, so concurrent trajectories never share state. The
    builder is picked by the one source the spec names: dataset rows + a rubric (a
    single-turn env), an ``env_url`` (a list spreads sessions across the URLs, round-robin),
    or an ``entrypoint`` (built in this process, with its ``factory``, ``env_config`` and
    ``env_packages``). An entrypoint with hosting fields (``env_hosts``, ...) is served by
    Ray env hosts instead: the factory is then a
    :class:`~agile_llmenvs.hosting.HostedHarnessFactory`, whose ``close()`` stops the hosts.
    The turn budget rides along. Unset in the manifest, it is the env's own: an entrypoint
    env's ``max_turns`` attribute (a text env without one is single-turn), or ``max_turns``
    in the state of a served env or an OpenEnv ``Environment``, which must advertise one.

    Args:
        spec: The env spec, with ``env_type: rollout``.
        tokenizer: The tokenizer, shared by all instances.
        max_model_len: The model's context length.
        max_output_tokens: Tokens generated per turn; prompts are kept to
            ``max_model_len - max_output_tokens`` so the next generation always fits.
        seed: Seed of a dataset-backed env's train/test split.
        allow_install: Install missing ``env_packages`` on this first build.
        split: Which rows a dataset-backed env plays: ``train``, or the held-out ``test``
            split (``train_test_split``, or the source's own); other sources have one.
        vision_processor: A vision-language policy's processor: the env's images are shown
            to it (see :class:`~agile_llmenvs.llm_envs.HarnessConfig`).

    Returns:
        A zero-argument callable that creates a harness, and the rollout's turn budget.

    Raises:
        EnvBuildError: the spec is not a rollout spec, names an ``env_image`` (that needs an
            orchestrator placing Pods), its env hosts did not start in time, its source
            cannot be built (missing rubric function, unreadable rows, ...), or ``max_turns``
            is unset and a served env (or an OpenEnv ``Environment``) advertises none.
        OptionalDependencyError: the hosting fields are set and ray is not installed.
    """
    if spec.env_type != "rollout":
        raise EnvBuildError(f"{spec.label!r} is a dataset env: build it with make_llm_env")
    settings = spec_settings(spec)
    settings.pop("max_turns", None)
    if vision_processor is not None:
        settings["vision_processor"] = vision_processor
    if max_model_len is not None:
        settings["max_model_len"] = max(1, max_model_len - (max_output_tokens or 0))
    if spec.source == "dataset":
        return _dataset_factory(spec, tokenizer, settings, seed, split), 1
    if spec.source == "env_url":
        return _url_factory(spec, tokenizer, settings)
    if spec.source == "entrypoint":
        return _entrypoint_factory(spec, tokenizer, settings, allow_install)
    raise EnvBuildError(
        f"env_image {spec.env_image!r} runs as its own Pod, placed by an orchestrator (the Ray "
        "runtime); this process cannot start it. Serve the env yourself and set env_url."
    )


def _dataset_factory(
    spec: LLMEnvSpec,
    tokenizer: Any,
    settings: dict[str, Any],
    seed: int | None,
    split: Literal["train", "test"],
) -> HarnessFactory:
    from agile_llmenvs.llm_envs.rows import load_rows

    assert spec.rubric_file_path is not None  # the spec guarantees a rubric with rows
    rubric = load_rubric(spec.rubric_file_path, spec.rubric_name)
    train, test = load_rows(spec, seed or 0)
    rows = (train if split == "train" else test).to_list()
    if not rows:
        raise EnvBuildError(
            f"{spec.label!r} has no {split} rows: set `train_test_split` to hold some out"
        )
    RubricEnv(rows, rubric, prompt_template=spec.prompt_template)  # fail here, not per slot

    def factory() -> RolloutHarness:
        env = RubricEnv(
            rows, rubric, prompt_template=spec.prompt_template, max_reward=spec.max_reward
        )
        return RolloutHarness(InProcessEnvClient(env), tokenizer, 1, **settings)

    return factory


def _url_factory(
    spec: LLMEnvSpec, tokenizer: Any, settings: dict[str, Any]
) -> tuple[HarnessFactory, int]:
    urls = itertools.cycle(spec.env_urls)
    lock = threading.Lock()
    timeout = settings.get("timeout_s")

    def next_url() -> str:
        with lock:
            return next(urls)

    max_turns = spec.max_turns or served_turn_budget(spec.env_urls[0], timeout_s=timeout)

    def factory() -> RolloutHarness:
        client = RemoteEnvClient(
            next_url(), timeout_s=timeout, action_field=settings.get("action_field", "message")
        )
        return RolloutHarness(client, tokenizer, max_turns, **settings)

    return factory, max_turns


def _entrypoint_factory(
    spec: LLMEnvSpec, tokenizer: Any, settings: dict[str, Any], allow_install: bool
) -> tuple[HarnessFactory, int]:
    if any(f in spec.model_fields_set and getattr(spec, f) for f in HOSTING_FIELDS):
        from agile_llmenvs.hosting.factory import HostedHarnessFactory

        hosted = HostedHarnessFactory.start(spec, tokenizer, settings, allow_install=allow_install)
        return hosted, hosted.max_turns
    assert spec.entrypoint is not None
    ensure_env_packages(spec.env_packages, allow_install=allow_install)
    make_env = env_factory(spec.entrypoint, spec.env_config, factory=spec.factory)
    max_turns = spec.max_turns
    if max_turns is None:  # the env may declare its own budget
        probe = make_env()
        try:
            max_turns = env_turn_budget(probe, label=spec.entrypoint)
        finally:
            close = getattr(probe, "close", None)  # a registry's env may have none (GEM's)
            if callable(close):
                close()
    action_field = settings.get("action_field", "message")

    def factory() -> RolloutHarness:
        client = InProcessEnvClient(make_env(), action_field=action_field)
        return RolloutHarness(client, tokenizer, max_turns, **settings)

    return factory, max_turns


def env_build_error(spec: LLMEnvSpec, exc: Exception) -> EnvBuildError:
    """The error for a rollout env that could not be built: the field to fix and what its
    construction raised (with the env's file and line)."""
    location = exception_location(exc)
    at = f" (at {location})" if location else ""
    return EnvBuildError(f"env.entrypoint: cannot build the env: {type(exc).__name__}: {exc}{at}")


@contextmanager
def building(spec: LLMEnvSpec) -> Iterator[None]:
    """Inside: building ``spec``'s envs. What an env's own constructor raises (a wrong
    ``env_config`` key, say) leaves as :func:`env_build_error`; this library's errors as
    they are."""
    try:
        yield
    except AgileLLMEnvsError:
        raise
    except Exception as exc:
        raise env_build_error(spec, exc) from exc
