"""Tests for the vectorised PettingZoo parallel envs (real subprocesses, no mocks)."""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle
import numpy as np
import pytest
from gymnasium.spaces import Box, Dict, Discrete, MultiDiscrete
from pettingzoo import ParallelEnv
from pettingzoo.test import parallel_api_test

from agile_llmenvs.envs.pettingzoo_vec import (
    AUTORESET_KEY,
    FINAL_INFO_KEY,
    FINAL_OBS_KEY,
    AsyncPettingZooVecEnv,
    SyncPettingZooVecEnv,
    VecEnvStateError,
    VecEnvWorkerError,
)
from agile_llmenvs.errors import AgileLLMEnvsError, EnvBuildError

# The test module may not be importable by name in worker processes (importlib import mode):
# ship the classes below to the workers by value.
if __name__ in sys.modules:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

AGENTS = ["a_0", "a_1"]
N_ENVS = 4
SEED = 7
EPISODE_LEN = 3


class ToyParallelEnv(ParallelEnv):
    """Deterministic 2-agent env: episodes of exactly 3 steps, reward = action.

    Observation of an agent: ``[base, t, last_action]`` (float32), ``base`` drawn from the reset
    seed. With ``a_1_dies`` agent ``a_1`` terminates after step 1. ``fail_at_step`` makes
    ``step`` raise at that episode step.
    """

    metadata = {"name": "toy_parallel_v0", "render_modes": []}

    def __init__(self, a_1_dies: bool = False, fail_at_step: int | None = None) -> None:
        self.possible_agents = list(AGENTS)
        self.agents: list[str] = []
        self.a_1_dies = a_1_dies
        self.fail_at_step = fail_at_step
        self._obs_space = Box(0.0, 1000.0, shape=(3,), dtype=np.float32)
        self._act_space = Discrete(3)
        self._rng = np.random.default_rng(0)
        self.t = 0

    def observation_space(self, agent: str) -> Any:
        return self._obs_space

    def action_space(self, agent: str) -> Any:
        return self._act_space

    def _obs(self, agent: str, action: int = 0) -> Any:
        return np.array([self._base[agent], self.t, action], dtype=np.float32)

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self.agents = list(self.possible_agents)
        self.t = 0
        self._base = {a: float(self._rng.integers(1, 1000)) for a in self.possible_agents}
        return {a: self._obs(a) for a in self.agents}, {a: {"t": 0} for a in self.agents}

    def step(self, actions: dict) -> tuple[dict, dict, dict, dict, dict]:
        assert set(actions) == set(self.agents), f"actions {actions} for live {self.agents}"
        self.t += 1
        if self.t == self.fail_at_step:
            raise RuntimeError("toy env exploded")
        obs = {a: self._obs(a, int(actions[a])) for a in self.agents}
        rewards = {a: float(actions[a]) for a in self.agents}
        terms = {a: self.a_1_dies and a == "a_1" and self.t == 1 for a in self.agents}
        truncs = {a: self.t >= EPISODE_LEN for a in self.agents}
        infos = {a: {"t": self.t} for a in self.agents}
        self.agents = [a for a in self.agents if not (terms[a] or truncs[a])]
        return obs, rewards, terms, truncs, infos


class DictObsToyEnv(ToyParallelEnv):
    """The toy env with a ``Dict`` observation space (checks nested batching)."""

    def __init__(self, a_1_dies: bool = False) -> None:
        super().__init__(a_1_dies=a_1_dies)
        self._obs_space = Dict({"vec": Box(0.0, 1000.0, (3,), np.float32), "t": Discrete(5)})

    def _obs(self, agent: str, action: int = 0) -> Any:
        return {"vec": super()._obs(agent, action), "t": self.t}


def dies(i: int) -> bool:
    """Whether ``a_1`` dies after step 1 in sub-env ``i`` (odd sub-envs)."""
    return i % 2 == 1


def toy_fns(n: int = N_ENVS, **kwargs: Any) -> list[Callable[[], ParallelEnv]]:
    return [functools.partial(ToyParallelEnv, a_1_dies=dies(i), **kwargs) for i in range(n)]


def actions_at(t: int, n: int = N_ENVS) -> dict[str, np.ndarray]:
    """A fixed, varied action schedule: step ``t`` -> agent -> (n,) int64 actions."""
    return {
        "a_0": np.array([(t + i) % 3 for i in range(n)], dtype=np.int64),
        "a_1": np.array([(t + 2 * i + 1) % 3 for i in range(n)], dtype=np.int64),
    }


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Exact structural equality, including numpy dtypes and shapes."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        np.testing.assert_array_equal(a, b, err_msg=path)
    else:
        assert a == b, path


def run_trajectory(venv: Any, steps: int) -> list[Any]:
    out: list[Any] = [venv.reset(seed=SEED)]
    out += [venv.step(actions_at(t)) for t in range(1, steps + 1)]
    return out


def reference_run(i: int, steps: int) -> list[tuple[dict, dict | None]]:
    """Run sub-env ``i`` alone with manual resets: per step, (step obs, reset obs or None)."""
    env = ToyParallelEnv(a_1_dies=dies(i))
    env.reset(seed=SEED + i)
    out: list[tuple[dict, dict | None]] = []
    for t in range(1, steps + 1):
        step_obs = env.step({a: actions_at(t)[a][i] for a in env.agents})[0]
        out.append((step_obs, None if env.agents else env.reset()[0]))
    return out


@pytest.fixture(scope="module")
def async_env() -> Iterator[AsyncPettingZooVecEnv]:
    with AsyncPettingZooVecEnv(toy_fns()) as venv:
        yield venv


@pytest.fixture(scope="module")
def sync_trajectory() -> list[Any]:
    with SyncPettingZooVecEnv(toy_fns()) as venv:
        return run_trajectory(venv, 2 * EPISODE_LEN + 1)


def test_toy_env_passes_pettingzoo_parallel_api_test() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parallel_api_test(ToyParallelEnv(a_1_dies=True), num_cycles=10)
        parallel_api_test(ToyParallelEnv(a_1_dies=False), num_cycles=10)


def test_spaces_and_attributes(async_env: AsyncPettingZooVecEnv) -> None:
    assert async_env.num_envs == N_ENVS
    assert async_env.possible_agents == AGENTS
    assert async_env.agents == AGENTS
    for agent in AGENTS:
        assert async_env.single_observation_space(agent) == Box(0.0, 1000.0, (3,), np.float32)
        assert async_env.single_action_space(agent) == Discrete(3)
        assert async_env.observation_space(agent) == Box(0.0, 1000.0, (N_ENVS, 3), np.float32)
        assert async_env.action_space(agent) == MultiDiscrete([3] * N_ENVS)


def test_reset_shapes_dtypes_and_seeding(async_env: AsyncPettingZooVecEnv) -> None:
    obs, infos = async_env.reset(seed=SEED)
    assert obs.keys() == infos.keys() == set(AGENTS)
    for agent in AGENTS:
        assert obs[agent].shape == (N_ENVS, 3)
        assert obs[agent].dtype == np.float32
        assert infos[agent] == [{"t": 0}] * N_ENVS
    for i in range(N_ENVS):  # int seed s seeds sub-env i with s + i
        expected, _ = ToyParallelEnv().reset(seed=SEED + i)
        for agent in AGENTS:
            np.testing.assert_array_equal(obs[agent][i], expected[agent])
    assert_same(async_env.reset(seed=SEED), (obs, infos))  # repeatable
    with SyncPettingZooVecEnv(toy_fns()) as sync:
        assert_same(sync.reset(seed=SEED), (obs, infos))
        assert_same(sync.reset(seed=[SEED + i for i in range(N_ENVS)]), (obs, infos))
    assert not np.array_equal(async_env.reset(seed=SEED + 100)[0]["a_0"], obs["a_0"])


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_step_values_dead_agents_and_autoreset(
    kind: str, async_env: AsyncPettingZooVecEnv, sync_trajectory: list[Any]
) -> None:
    traj = sync_trajectory if kind == "sync" else run_trajectory(async_env, 2 * EPISODE_LEN + 1)
    refs = [reference_run(i, len(traj) - 1) for i in range(N_ENVS)]
    for t in range(1, len(traj)):
        obs, rewards, terms, truncs, infos = traj[t]
        acts, k = actions_at(t), (t - 1) % EPISODE_LEN + 1  # k: step within the episode
        for agent in AGENTS:
            assert obs[agent].shape == (N_ENVS, 3)
            assert obs[agent].dtype == np.float32
            for arr, dtype in ((rewards, np.float32), (terms, np.bool_), (truncs, np.bool_)):
                assert arr[agent].shape == (N_ENVS,)
                assert arr[agent].dtype == dtype
            assert isinstance(infos[agent], list)
            assert len(infos[agent]) == N_ENVS
        for i in range(N_ENVS):
            step_obs, reset_obs = refs[i][t - 1]
            a_1_alive = not dies(i) or k == 1
            alive = {"a_0": True, "a_1": a_1_alive}
            for agent in AGENTS:
                info = infos[agent][i]
                expected_reward = float(acts[agent][i]) if alive[agent] else 0.0
                assert rewards[agent][i] == expected_reward
                assert terms[agent][i] == (agent == "a_1" and dies(i))
                assert truncs[agent][i] == (alive[agent] and k == EPISODE_LEN)
                if k == EPISODE_LEN:  # auto-reset: obs is the fresh reset obs
                    assert reset_obs is not None
                    np.testing.assert_array_equal(obs[agent][i], reset_obs[agent])
                    assert info[AUTORESET_KEY] is True
                    assert info["t"] == 0
                    if alive[agent]:
                        np.testing.assert_array_equal(info[FINAL_OBS_KEY], step_obs[agent])
                        assert info[FINAL_INFO_KEY] == {"t": EPISODE_LEN}
                    else:
                        assert FINAL_OBS_KEY not in info
                        assert FINAL_INFO_KEY not in info
                elif alive[agent]:
                    np.testing.assert_array_equal(obs[agent][i], step_obs[agent])
                    assert obs[agent][i][2] == acts[agent][i]
                    assert info == {"t": k}
                else:  # dead agent: zeros, empty info
                    np.testing.assert_array_equal(obs[agent][i], np.zeros(3, np.float32))
                    assert info == {}


def test_async_matches_sync_over_trajectory(
    async_env: AsyncPettingZooVecEnv, sync_trajectory: list[Any]
) -> None:
    assert_same(run_trajectory(async_env, 2 * EPISODE_LEN + 1), sync_trajectory)


def test_step_async_wait_split_and_state_errors(async_env: AsyncPettingZooVecEnv) -> None:
    async_env.reset(seed=SEED)
    with pytest.raises(VecEnvStateError):
        async_env.step_wait()
    async_env.step_async(actions_at(1))
    with pytest.raises(VecEnvStateError):
        async_env.step_async(actions_at(1))
    split = async_env.step_wait(timeout=30.0)
    async_env.reset(seed=SEED)
    assert_same(split, async_env.step(actions_at(1)))


def test_bad_arguments_raise_value_error(async_env: AsyncPettingZooVecEnv) -> None:
    async_env.reset(seed=SEED)
    with pytest.raises(ValueError, match="num_envs=4"):
        async_env.step({"a_0": np.zeros(3, np.int64)})
    with pytest.raises(ValueError, match="unknown agent"):
        async_env.step({"nobody": np.zeros(N_ENVS, np.int64)})
    with pytest.raises(ValueError, match="seeds"):
        async_env.reset(seed=[1, 2])
    async_env.step(actions_at(1))  # still usable


def test_dict_observation_space_batches_and_zero_fills() -> None:
    with SyncPettingZooVecEnv([lambda: DictObsToyEnv(), lambda: DictObsToyEnv(True)]) as venv:
        assert venv.observation_space("a_1") == Dict(
            {"vec": Box(0.0, 1000.0, (2, 3), np.float32), "t": MultiDiscrete([5, 5])}
        )
        venv.reset(seed=0)
        venv.step(actions_at(1, n=2))
        obs = venv.step(actions_at(2, n=2))[0]
    assert obs["a_1"]["vec"].shape == (2, 3)
    assert obs["a_1"]["vec"].dtype == np.float32
    assert obs["a_1"]["t"].tolist() == [2, 0]  # sub-env 1: a_1 is dead -> zeros
    np.testing.assert_array_equal(obs["a_1"]["vec"][1], np.zeros(3, np.float32))
    assert obs["a_0"]["t"].tolist() == [2, 2]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_worker_exception_raises_and_closes(kind: str) -> None:
    fns = [functools.partial(ToyParallelEnv, fail_at_step=2 if i == 1 else None) for i in range(3)]
    venv: Any = SyncPettingZooVecEnv(fns) if kind == "sync" else AsyncPettingZooVecEnv(fns)
    venv.reset(seed=0)
    venv.step(actions_at(1, n=3))
    with pytest.raises(VecEnvWorkerError, match="sub-env 1") as err:
        venv.step(actions_at(2, n=3))
    assert err.value.index == 1
    assert "RuntimeError: toy env exploded" in str(err.value)
    assert isinstance(err.value, AgileLLMEnvsError)
    assert isinstance(err.value, RuntimeError)
    for proc in getattr(venv, "processes", []):
        assert not proc.is_alive()
    with pytest.raises(VecEnvStateError, match="closed"):
        venv.reset()
    venv.close()  # still idempotent


def test_close_is_idempotent_and_workers_exit() -> None:
    with AsyncPettingZooVecEnv(toy_fns(2)) as venv:
        procs = list(venv.processes)
        assert all(p.is_alive() for p in procs)
        venv.reset(seed=0)
        venv.step_async(actions_at(1, n=2))  # close must cope with a pending step
        venv.close(timeout=10.0)
        venv.close()
        assert [p.is_alive() for p in procs] == [False, False]
        assert [p.exitcode for p in procs] == [0, 0]  # exited cleanly, not terminated
    venv.close()
    with pytest.raises(VecEnvStateError):
        venv.step(actions_at(1, n=2))


def test_shipped_pettingzoo_env_without_possible_agents_is_rejected() -> None:
    """The only PettingZoo env importable here (no pygame/Box2D/ALE) is a test example env.

    It creates agents on the fly and has no ``possible_agents``, so it cannot be vectorised.
    """
    from pettingzoo.test.example_envs import generated_agents_parallel_v0

    with pytest.raises(EnvBuildError, match=r"(?s)sub-env 0 failed to build.*possible_agents"):
        SyncPettingZooVecEnv([generated_agents_parallel_v0.parallel_env])
    fns = [lambda: ToyParallelEnv(), generated_agents_parallel_v0.parallel_env]
    with pytest.raises(EnvBuildError, match=r"(?s)sub-env 1 failed to build.*possible_agents"):
        AsyncPettingZooVecEnv(fns)


def test_mismatched_sub_envs_are_rejected() -> None:
    with pytest.raises(EnvBuildError, match="sub-env 1 has agents/spaces"):
        SyncPettingZooVecEnv([ToyParallelEnv, DictObsToyEnv])
