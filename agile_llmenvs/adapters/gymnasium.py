"""A classic gymnasium env with a discrete action space, played in text."""

from __future__ import annotations

import re
from typing import Any

import gymnasium as gym
import numpy as np

from agile_llmenvs.errors import EnvBuildError

__all__ = ["GymTextEnv", "make"]

_INTEGER = re.compile(r"-?\d+")


class GymTextEnv:
    """A gymnasium env as a text env: observations printed, actions parsed.

    The observation is shown as text with the legal actions; the policy's first integer is
    the action. A reply without a legal action does not step the env: it scores 0.0, names
    the problem in ``info["invalid_action"]`` (use ``action_error_field: invalid_action``) and
    the episode goes on. ``max_turns`` is the env's own step limit, when it has one.

    Args:
        env: A gymnasium env with a ``Discrete`` action space.
        action_names: Optional names of the actions, shown in the prompt.
    """

    def __init__(self, env: gym.Env[Any, Any], action_names: list[str] | None = None) -> None:
        if not isinstance(env.action_space, gym.spaces.Discrete):
            raise EnvBuildError(
                f"a text gymnasium env needs a Discrete action space, got {env.action_space}"
            )
        self.env = env
        self.actions = int(env.action_space.n)
        self.action_names = action_names
        limit = getattr(env.spec, "max_episode_steps", None) if env.spec else None
        self.max_turns = int(limit) if limit else None

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        """Reset the gymnasium env (``seed`` passes through)."""
        observation, info = self.env.reset(seed=seed)
        return self._text(observation), _plain(info)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Play the first integer in the policy's text."""
        match = _INTEGER.search(action)
        if match is None or not 0 <= int(match.group()) < self.actions:
            problem = f"no action in 0..{self.actions - 1} found in the reply"
            return (
                f"Invalid: {problem}. Reply with one action number.",
                0.0,
                False,
                False,
                {"invalid_action": problem},
            )
        observation, reward, terminated, truncated, info = self.env.step(int(match.group()))
        return (
            self._text(observation),
            float(reward),
            bool(terminated),
            bool(truncated),
            _plain(info),
        )

    def close(self) -> None:
        """Close the gymnasium env."""
        self.env.close()

    def _text(self, observation: Any) -> str:
        array = np.asarray(observation)
        if np.issubdtype(array.dtype, np.floating):
            array = array.astype(np.float64).round(4)
        values = array.tolist()
        legal = (
            ", ".join(f"{i} ({name})" for i, name in enumerate(self.action_names))
            if self.action_names
            else f"0..{self.actions - 1}"
        )
        return f"Observation: {values}\nActions: {legal}. Reply with one action number."


def make(env_id: str, *, action_names: list[str] | None = None, **kwargs: Any) -> GymTextEnv:
    """``gymnasium.make(env_id, **kwargs)`` as a text env.

    Raises:
        EnvBuildError: gymnasium cannot build ``env_id``, or its actions are not discrete.
    """
    try:
        env = gym.make(env_id, **kwargs)
    except Exception as exc:
        raise EnvBuildError(f"gymnasium could not build {env_id!r}: {exc}") from exc
    return GymTextEnv(env, action_names)


def _plain(info: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (v.tolist() if isinstance(v, np.ndarray | np.generic) else v) for k, v in info.items()
    }
