"""Small envs that ship with the package, so every manifest kind runs offline out of the box."""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces
from pettingzoo import ParallelEnv

__all__ = ["RendezvousEnv"]


class RendezvousEnv(ParallelEnv[str, np.ndarray, int]):
    """Two agents on a line of ``size`` cells try to meet; a PettingZoo parallel env.

    Each agent observes ``[own position, other position] / (size - 1)`` and moves left, stays or
    moves right (actions 0, 1, 2). Both are rewarded 1.0 on every step they share a cell, and
    the episode is truncated after ``max_steps`` steps.
    """

    metadata: dict[str, Any] = {"name": "rendezvous_v0", "render_modes": []}

    def __init__(self, size: int = 5, max_steps: int = 10) -> None:
        if size < 2:
            raise ValueError(f"size must be at least 2, got {size}")
        self.size = size
        self.max_steps = max_steps
        self.possible_agents = ["agent_0", "agent_1"]
        self.agents: list[str] = []
        self._positions = np.zeros(2, dtype=np.int64)
        self._steps = 0
        self._rng = np.random.default_rng()

    def observation_space(self, agent: str) -> spaces.Box:
        return spaces.Box(0.0, 1.0, shape=(2,), dtype=np.float32)

    def action_space(self, agent: str) -> spaces.Discrete:
        return spaces.Discrete(3)

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, dict[str, Any]]]:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self.agents = list(self.possible_agents)
        self._positions = self._rng.integers(0, self.size, size=2)
        self._steps = 0
        return self._observations(), {agent: {} for agent in self.agents}

    def step(self, actions: dict[str, int]) -> tuple[dict[str, Any], ...]:
        for index, agent in enumerate(self.possible_agents):
            move = int(actions[agent]) - 1
            self._positions[index] = np.clip(self._positions[index] + move, 0, self.size - 1)
        self._steps += 1
        met = float(self._positions[0] == self._positions[1])
        truncated = self._steps >= self.max_steps
        agents = list(self.agents)
        observations = self._observations()
        if truncated:
            self.agents = []
        return (
            observations,
            {agent: met for agent in agents},
            {agent: False for agent in agents},
            {agent: truncated for agent in agents},
            {agent: {} for agent in agents},
        )

    def _observations(self) -> dict[str, np.ndarray]:
        scaled = self._positions.astype(np.float32) / (self.size - 1)
        return {
            "agent_0": scaled.copy(),
            "agent_1": scaled[::-1].copy(),
        }
