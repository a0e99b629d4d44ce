"""Offline RL: a gym env for evaluation plus the fixed transitions learned from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv

from agile_llmenvs.envs.gym import make_gym_env
from agile_llmenvs.errors import EnvBuildError, OptionalDependencyError
from agile_llmenvs.specs import OfflineEnvSpec

__all__ = ["TRANSITION_KEYS", "OfflineEnv", "load_offline_dataset", "make_offline_env"]

#: The arrays of an offline dataset, one row per transition.
TRANSITION_KEYS = ("observations", "actions", "rewards", "next_observations", "terminals")


@dataclass
class OfflineEnv:
    """An offline env: the vector env to evaluate in, and the transitions to learn from."""

    env: AsyncVectorEnv | SyncVectorEnv
    dataset: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.dataset["rewards"])

    def close(self) -> None:
        """Close the evaluation env."""
        self.env.close()


def make_offline_env(spec: OfflineEnvSpec) -> OfflineEnv:
    """Build the evaluation env and load the dataset; the two must agree on shapes.

    Raises:
        EnvBuildError: the dataset is missing arrays, has arrays of different lengths, or its
            observations do not fit the env's observation space.
    """
    dataset = load_offline_dataset(spec)
    env = make_gym_env(spec)
    expected = env.single_observation_space.shape
    got = dataset["observations"].shape[1:]
    if expected is not None and tuple(got) != tuple(expected):
        env.close()
        raise EnvBuildError(
            f"dataset_path: observations have shape {tuple(got)} per row but env "
            f"{spec.env_id!r} observes {tuple(expected)}"
        )
    return OfflineEnv(env=env, dataset=dataset)


def load_offline_dataset(spec: OfflineEnvSpec) -> dict[str, np.ndarray]:
    """Load the spec's transitions as arrays keyed by :data:`TRANSITION_KEYS`."""
    if spec.minari_dataset_id is not None:
        return _load_minari(spec.minari_dataset_id, download=spec.remote)
    assert spec.dataset_path is not None  # the spec guarantees one source
    path = Path(spec.dataset_path)
    if not path.is_file():
        raise EnvBuildError(f"dataset_path: file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".npz":
        with np.load(path) as data:
            arrays = {key: data[key] for key in data.files}
    elif suffix in (".h5", ".hdf5"):
        arrays = _load_hdf5(path)
    else:
        raise EnvBuildError(f"dataset_path: expected a .npz, .h5 or .hdf5 file, got {str(path)!r}")
    return _check_transitions(arrays, str(path))


def _load_hdf5(path: Path) -> dict[str, np.ndarray]:
    try:
        import h5py
    except ImportError as exc:
        raise OptionalDependencyError("h5py", feature="reading .h5 offline datasets") from exc
    with h5py.File(path, "r") as handle:
        return {key: np.asarray(handle[key]) for key in TRANSITION_KEYS if key in handle}


def _load_minari(dataset_id: str, *, download: bool) -> dict[str, np.ndarray]:
    try:
        import minari
    except ImportError as exc:
        raise OptionalDependencyError("minari", feature="Minari offline datasets") from exc
    dataset = minari.load_dataset(dataset_id, download=download)
    parts: dict[str, list[Any]] = {key: [] for key in TRANSITION_KEYS}
    for episode in dataset.iterate_episodes():
        parts["observations"].append(episode.observations[:-1])
        parts["next_observations"].append(episode.observations[1:])
        parts["actions"].append(episode.actions)
        parts["rewards"].append(episode.rewards)
        parts["terminals"].append(episode.terminations)
    return _check_transitions({k: np.concatenate(v) for k, v in parts.items()}, dataset_id)


def _check_transitions(arrays: dict[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    missing = [key for key in TRANSITION_KEYS if key not in arrays]
    if missing:
        raise EnvBuildError(
            f"dataset_path: {source} lacks the arrays {missing}; an offline dataset holds "
            f"{list(TRANSITION_KEYS)}"
        )
    lengths = {key: len(arrays[key]) for key in TRANSITION_KEYS}
    if len(set(lengths.values())) != 1:
        raise EnvBuildError(f"dataset_path: {source} has arrays of different lengths: {lengths}")
    return {key: arrays[key] for key in TRANSITION_KEYS}
