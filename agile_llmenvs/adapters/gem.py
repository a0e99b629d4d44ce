"""GEM envs (``gem-llm``, the ``envs`` extra) as text envs: ``factory: gem:make`` or this
module's :func:`make` with a registry id such as ``game:GuessTheNumber-v0-easy``."""

from __future__ import annotations

from typing import Any

from agile_llmenvs.errors import EnvBuildError, OptionalDependencyError

__all__ = ["GemTextEnv", "make"]


class GemTextEnv:
    """A GEM env behind the :class:`~agile_llmenvs.llm_envs.TextEnv` contract.

    GEM envs are already gymnasium-shaped with string observations; this forwards them,
    drops reset kwargs GEM does not take (a collector's ``row_index``), and exposes the env's
    own ``max_turns`` so the harness's turn budget can be probed from it.
    """

    def __init__(self, env: Any) -> None:
        self.env = env
        self.max_turns = int(getattr(env, "max_turns", 0) or 0) or None

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        """Start a game (``seed`` picks it)."""
        observation, info = self.env.reset(seed=seed)
        return str(observation), dict(info or {})

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Play the policy's text."""
        observation, reward, terminated, truncated, info = self.env.step(action)
        return str(observation), float(reward), bool(terminated), bool(truncated), dict(info)

    def close(self) -> None:
        """Close the GEM env."""
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


def make(env_id: str, **kwargs: Any) -> GemTextEnv:
    """Build GEM env ``env_id`` as a text env.

    Raises:
        OptionalDependencyError: ``gem-llm`` is not installed.
        EnvBuildError: GEM has no env ``env_id`` (or refuses ``kwargs``).
    """
    try:
        import gem
    except ImportError as exc:
        raise OptionalDependencyError(
            "gem-llm", extra="envs", feature=f"GEM env {env_id!r}"
        ) from exc
    try:
        return GemTextEnv(gem.make(env_id, **kwargs))
    except Exception as exc:
        raise EnvBuildError(f"GEM could not build {env_id!r}: {type(exc).__name__}: {exc}") from exc
