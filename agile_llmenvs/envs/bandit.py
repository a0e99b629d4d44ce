"""A tabular dataset as a contextual-bandit environment."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, TypeAlias, runtime_checkable

import gymnasium as gym
import numpy as np
import pandas as pd
from gymnasium.vector import SyncVectorEnv

from agile_llmenvs._imports import load_object
from agile_llmenvs.errors import EnvBuildError
from agile_llmenvs.specs import BanditEnvSpec

__all__ = ["BanditEnv", "BanditEnvProtocol", "make_bandit_env", "read_table"]

Table: TypeAlias = pd.DataFrame | pd.Series | str | Path


@runtime_checkable
class BanditEnvProtocol(Protocol):
    """What a bandit env offers: a context per round and a reward for the chosen arm."""

    num_arms: int

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]: ...

    def step(self, action: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]: ...


class BanditEnv(gym.Env[np.ndarray, np.int64]):
    """Contextual bandit over a labelled table: one arm per class, reward 1 for the right arm.

    Each round draws a row at random. The context has one row per arm, ``num_arms x
    (num_arms * num_features)``: arm ``k`` sees the row's features in its own block ``k`` and
    zeros elsewhere (the disjoint encoding of LinUCB/NeuralUCB). The reward is 1.0 when the
    chosen arm is the row's class, else 0.0. Episodes never end; every step is one round.

    Args:
        features: One row per context; non-numeric columns are one-hot encoded.
        targets: The class of each row (one column); classes are sorted into arm indices.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, features: pd.DataFrame, targets: pd.Series) -> None:
        if len(features) != len(targets):
            raise EnvBuildError(
                f"bandit tables disagree: {len(features)} feature rows, {len(targets)} targets"
            )
        if len(features) == 0:
            raise EnvBuildError("bandit tables are empty; give at least one row")
        encoded = pd.get_dummies(features, dtype=np.float32)
        self.feature_names: list[str] = [str(c) for c in encoded.columns]
        self._features = encoded.to_numpy(dtype=np.float32)
        self.classes: list[Any] = sorted(pd.unique(targets).tolist())
        index = {label: arm for arm, label in enumerate(self.classes)}
        self._arms = np.array([index[t] for t in targets], dtype=np.int64)
        self.num_arms = len(self.classes)
        self.num_features = self._features.shape[1]
        self.context_dim = self.num_arms * self.num_features
        self.observation_space = gym.spaces.Box(
            -np.inf, np.inf, (self.num_arms, self.context_dim), np.float32
        )
        self.action_space = gym.spaces.Discrete(self.num_arms)
        self._row = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Start drawing rows (reseeded when ``seed`` is given); returns the first context."""
        super().reset(seed=seed)
        return self._draw(), {"row": self._row}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Score ``action`` against the current row, then draw the next row's context."""
        if not self.action_space.contains(np.int64(action)):
            raise ValueError(f"action must be an arm in 0..{self.num_arms - 1}, got {action!r}")
        correct = int(self._arms[self._row])
        reward = 1.0 if int(action) == correct else 0.0
        info = {"row": self._row, "correct_arm": correct, "regret": 1.0 - reward}
        return self._draw(), reward, False, False, info

    def _draw(self) -> np.ndarray:
        self._row = int(self.np_random.integers(len(self._arms)))
        context = np.zeros((self.num_arms, self.context_dim), dtype=np.float32)
        row = self._features[self._row]
        for arm in range(self.num_arms):
            start = arm * self.num_features
            context[arm, start : start + self.num_features] = row
        return context


def read_table(table: Table, *, what: str) -> pd.DataFrame:
    """A DataFrame from a DataFrame, a Series, or a CSV / JSON lines / JSON / parquet file."""
    if isinstance(table, pd.Series):
        return table.to_frame()
    if isinstance(table, pd.DataFrame):
        return table
    path = Path(table)
    readers = {
        ".csv": pd.read_csv,
        ".jsonl": lambda p: pd.read_json(p, lines=True),
        ".json": pd.read_json,
        ".parquet": pd.read_parquet,
    }
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise EnvBuildError(
            f"{what}: expected a .csv, .jsonl, .json or .parquet file, got {str(path)!r}"
        )
    if not path.is_file():
        raise EnvBuildError(f"{what}: file {str(path)!r} does not exist")
    return reader(path)


def make_bandit_env(
    spec: BanditEnvSpec,
    *,
    features: Table | None = None,
    targets: Table | None = None,
    seed: int | None = None,
) -> BanditEnvProtocol | SyncVectorEnv:
    """Construct a bandit environment from a spec, or from in-memory tables.

    Tables given as arguments take precedence over the spec's file paths. With
    ``spec.num_envs > 1`` the copies are returned as a ``SyncVectorEnv``.

    Raises:
        EnvBuildError: no tables, unreadable tables, or tables of different lengths.
    """
    features = features if features is not None else spec.features
    targets = targets if targets is not None else spec.targets
    if features is None or targets is None:
        raise EnvBuildError(
            "a bandit env needs `features` and `targets`: set them in the spec or pass tables"
        )
    feature_frame = read_table(features, what="features")
    target_frame = read_table(targets, what="targets")
    if target_frame.shape[1] != 1:
        raise EnvBuildError(
            f"targets: expected one column of classes, got {target_frame.shape[1]}: "
            f"{list(target_frame.columns)}"
        )
    target_column = target_frame.iloc[:, 0]
    env_class = load_object(spec.entrypoint, file=spec.path) if spec.entrypoint else BanditEnv
    kwargs = spec.env_config or {}

    def build() -> Any:
        return env_class(feature_frame, target_column, **kwargs)

    env: Any = build() if spec.num_envs == 1 else SyncVectorEnv([build] * spec.num_envs)
    if seed is not None:
        env.reset(seed=seed)
    return env
