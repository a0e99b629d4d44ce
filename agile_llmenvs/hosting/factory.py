"""The rollout factory of an entrypoint env on env hosts: a harness per call, a pool behind."""

from __future__ import annotations

from typing import Any

from agile_llmenvs.hosting.client import HostedEnvClient
from agile_llmenvs.hosting.config import HostConfig
from agile_llmenvs.hosting.pool import EnvHostPool
from agile_llmenvs.llm_envs.from_spec import unknown_turn_budget
from agile_llmenvs.llm_envs.harness import RolloutHarness
from agile_llmenvs.specs import LLMEnvSpec

__all__ = ["HostedHarnessFactory"]


class HostedHarnessFactory:
    """Builds :class:`RolloutHarness` instances whose sessions live on a pool of env hosts.

    Each call makes a harness over a fresh :class:`HostedEnvClient`; sessions spread over the
    hosts, least-loaded first, at most ``env_sessions_per_host`` on each. :meth:`close`
    stops the hosts (the collector closes only the sessions).

    Args:
        pool: The started hosts.
        tokenizer: The tokenizer shared by every harness.
        max_turns: The rollout's turn budget.
        settings: Harness settings (``timeout_s``, ``action_field``, ...).
    """

    def __init__(
        self, pool: EnvHostPool, tokenizer: Any, max_turns: int, settings: dict[str, Any]
    ) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        self.settings = dict(settings)

    @classmethod
    def start(
        cls,
        spec: LLMEnvSpec,
        tokenizer: Any,
        settings: dict[str, Any],
        *,
        allow_install: bool = False,
    ) -> HostedHarnessFactory:
        """Start the spec's env hosts and wait until each is ready.

        Raises:
            EnvBuildError: the hosting fields cannot work together, a host failed to
                start or was not ready in time, or the env advertises no turn budget and the
                spec sets no ``max_turns``.
            OptionalDependencyError: ray is not installed.
        """
        pool = EnvHostPool(HostConfig.from_spec(spec, allow_install=allow_install))
        max_turns = spec.max_turns or pool.max_turns
        if max_turns is None:
            pool.close()
            raise unknown_turn_budget(f"the env {spec.entrypoint!r} on the env hosts")
        return cls(pool, tokenizer, max_turns, settings)

    def __call__(self) -> RolloutHarness:
        """A harness over a new session (opened on its first reset)."""
        client = HostedEnvClient(
            self.pool,
            timeout_s=self.settings.get("timeout_s"),
            action_field=self.settings.get("action_field", "message"),
        )
        return RolloutHarness(client, self.tokenizer, self.max_turns, **self.settings)

    def close(self) -> None:
        """Stop the env hosts; idempotent."""
        self.pool.close()

    def __enter__(self) -> HostedHarnessFactory:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
