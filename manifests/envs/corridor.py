"""A custom gymnasium env loaded from this file by ``manifests/custom_gym.yaml``."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np


class Corridor(gym.Env[np.ndarray, np.int64]):
    """Walk right along a corridor of ``length`` cells; reward 1.0 on reaching the end."""

    def __init__(self, length: int = 5) -> None:
        self.length = length
        self.observation_space = gym.spaces.Box(0.0, 1.0, shape=(1,), dtype=np.float64)
        self.action_space = gym.spaces.Discrete(2)  # 0: left, 1: right
        self._position = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._position = 0
        return self._observation(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        step = 1 if int(action) == 1 else -1
        self._position = int(np.clip(self._position + step, 0, self.length - 1))
        done = self._position == self.length - 1
        return self._observation(), float(done), done, False, {"position": self._position}

    def _observation(self) -> np.ndarray:
        return np.array([self._position / (self.length - 1)], dtype=np.float64)
