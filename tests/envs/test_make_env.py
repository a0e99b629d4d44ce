"""make_env and its builders on real gymnasium, PettingZoo and pandas objects."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pandas as pd
import pytest
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv

from agile_llmenvs.envs import (
    BanditEnv,
    OfflineEnv,
    make_bandit_env,
    make_env,
    make_gym_env,
    make_single_env,
)
from agile_llmenvs.errors import AgileLLMEnvsError, EnvBuildError, ImportPathError
from agile_llmenvs.specs import (
    BanditEnvSpec,
    GymEnvSpec,
    LLMEnvSpec,
    OfflineEnvSpec,
    load_manifest,
)

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"


class AddStepCount(gym.Wrapper[Any, Any, Any, Any]):
    """Test wrapper: reports how many steps it saw and scales rewards by ``scale``."""

    def __init__(self, env: gym.Env[Any, Any], scale: float = 1.0) -> None:
        super().__init__(env)
        self.scale = scale
        self.count = 0

    def step(self, action: Any) -> Any:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.count += 1
        return obs, reward * self.scale, terminated, truncated, {**info, "count": self.count}


@pytest.mark.parametrize(("sync", "cls"), [(True, SyncVectorEnv), (False, AsyncVectorEnv)])
def test_cartpole_vector_env(sync: bool, cls: type) -> None:
    env = make_env(GymEnvSpec(name="CartPole", version=1, num_envs=4, sync=sync))
    try:
        assert type(env) is cls
        assert env.num_envs == 4
        obs, _ = env.reset(seed=123)
        assert obs.shape == (4, 4)
        assert obs.dtype == np.float32
        reference = gym.make("CartPole-v1")
        for index in range(4):
            expected, _ = reference.reset(seed=123 + index)
            np.testing.assert_array_equal(obs[index], expected)
        obs, rewards, terminated, truncated, _ = env.step(np.ones(4, dtype=np.int64))
        assert rewards.tolist() == [1.0, 1.0, 1.0, 1.0]
        assert terminated.dtype == np.bool_
        assert truncated.shape == (4,)
    finally:
        env.close()


def test_sync_and_async_give_the_same_trajectory() -> None:
    results = []
    for sync in (True, False):
        env = make_env(GymEnvSpec(name="CartPole-v1", num_envs=4, sync=sync))
        obs, _ = env.reset(seed=5)
        trajectory = [obs]
        for step in range(40):
            obs, *_ = env.step(np.array([(step + i) % 2 for i in range(4)]))
            trajectory.append(obs)
        env.close()
        results.append(np.stack(trajectory))
    np.testing.assert_array_equal(results[0], results[1])


def test_custom_entrypoint_with_wrappers_from_a_file() -> None:
    manifest = load_manifest(MANIFESTS / "custom_gym.yaml")
    spec = manifest.env.model_copy(
        update={
            "env_wrappers": [
                *manifest.env.env_wrappers,  # type: ignore[union-attr]
                (f"{__name__}:AddStepCount", {"scale": 2.0}),
            ],
        }
    )
    env = make_env(spec)
    try:
        assert isinstance(env, SyncVectorEnv)
        assert env.num_envs == 2
        obs, _ = env.reset(seed=0)
        assert obs.dtype == np.float32  # default_type casts the env's float64 observations
        np.testing.assert_array_equal(obs, np.zeros((2, 1), dtype=np.float32))
        rewards = []
        for _ in range(5):  # corridor of length 6: five steps right reach the end
            obs, reward, terminated, _, info = env.step(np.ones(2, dtype=np.int64))
            rewards.append(reward.tolist())
        assert rewards == [[0.0, 0.0]] * 4 + [[2.0, 2.0]]
        assert terminated.tolist() == [True, True]
        assert info["count"].tolist() == [5, 5]
        np.testing.assert_array_equal(obs, np.ones((2, 1), dtype=np.float32))
        obs, reward, terminated, _, _ = env.step(np.ones(2, dtype=np.int64))  # next-step reset
        np.testing.assert_array_equal(obs, np.zeros((2, 1), dtype=np.float32))
        assert reward.tolist() == [0.0, 0.0]
        assert terminated.tolist() == [False, False]
    finally:
        env.close()


def test_time_limit_wrapper_from_the_manifest_truncates() -> None:
    spec = load_manifest(MANIFESTS / "custom_gym.yaml").env
    single = make_single_env(spec)  # type: ignore[arg-type]
    single.reset(seed=0)
    truncated = False
    steps = 0
    while not truncated:
        _, _, _, truncated, _ = single.step(0)  # walk left forever: only the limit ends it
        steps += 1
    assert steps == 20


def test_extra_and_call_time_wrappers_apply_after_the_spec_wrappers() -> None:
    env = make_gym_env(
        GymEnvSpec(name="CartPole-v1", num_envs=2, sync=True),
        wrappers=[(AddStepCount, {"scale": 3.0})],
        extra_wrappers=[gym.wrappers.RecordEpisodeStatistics],
    )
    env.reset(seed=0)
    _, rewards, *_, info = env.step(np.zeros(2, dtype=np.int64))
    assert rewards.tolist() == [3.0, 3.0]
    assert info["count"].tolist() == [1, 1]
    env.close()


def test_factory_receives_the_env_id() -> None:
    env = make_single_env(
        GymEnvSpec(
            name="CartPole-v1", factory="gymnasium:make", env_config={"max_episode_steps": 7}
        )
    )
    env.reset(seed=0)
    steps = 0
    truncated = terminated = False
    while not (truncated or terminated):
        _, _, terminated, truncated, _ = env.step(steps % 2)
        steps += 1
    assert env.spec.id == "CartPole-v1"
    assert steps == 7


def test_build_errors_are_clear() -> None:
    with pytest.raises(EnvBuildError, match="cannot build env 'NoSuchEnv-v0'"):
        make_single_env(GymEnvSpec(name="NoSuchEnv-v0"))
    with pytest.raises(ImportPathError, match="cannot import module 'no_such_module'"):
        make_single_env(GymEnvSpec(name="x", entrypoint="no_such_module:Env"))
    with pytest.raises(
        ImportPathError,
        match=r"has no attribute 'CartPol'\. Did you mean "
        r"'CartPoleEnv'\?",
    ):
        make_single_env(
            GymEnvSpec(name="x", entrypoint="gymnasium.envs.classic_control.cartpole:CartPol")
        )
    with pytest.raises(EnvBuildError, match=r"env_wrappers: 'AddStepCount' failed: TypeError"):
        make_single_env(
            GymEnvSpec(name="CartPole-v1", env_wrappers=[(f"{__name__}:AddStepCount", {"bad": 1})])
        )
    with pytest.raises(EnvBuildError, match=r"env_config: cannot read 'missing\.yaml'"):
        make_single_env(GymEnvSpec(name="CartPole-v1", env_config="missing.yaml"))


def test_env_config_from_a_yaml_file(tmp_path: Path) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text("max_episode_steps: 3\n")
    env = make_single_env(GymEnvSpec(name="CartPole-v1", env_config=str(config)))
    env.reset(seed=0)
    assert [env.step(i % 2)[3] for i in range(3)] == [False, False, True]


def test_seed_makes_the_next_reset_reproducible() -> None:
    first = make_env(GymEnvSpec(name="CartPole-v1", num_envs=2, sync=True), seed=11)
    second = make_env(GymEnvSpec(name="CartPole-v1", num_envs=2, sync=True), seed=11)
    np.testing.assert_array_equal(first.reset()[0], second.reset()[0])
    assert first.action_space.sample().tolist() == second.action_space.sample().tolist()


def test_bandit_from_csv_manifest() -> None:
    spec = load_manifest(MANIFESTS / "bandit_blobs.yaml").env
    env = make_env(spec, seed=0)
    assert isinstance(env, BanditEnv)
    features = pd.read_csv(MANIFESTS / "data" / "blobs_features.csv")
    targets = pd.read_csv(MANIFESTS / "data" / "blobs_targets.csv")["label"]
    assert env.classes == ["class_0", "class_1", "class_2"]
    assert env.num_arms == 3
    assert env.feature_names == ["f0", "f1", "f2", "f3", "colour_blue", "colour_red"]
    assert env.observation_space.shape == (3, 18)
    context, info = env.reset(seed=3)
    row = info["row"]
    encoded = np.array(
        [*features.iloc[row, :4], features.colour[row] == "blue", features.colour[row] == "red"],
        dtype=np.float32,
    )
    for arm in range(3):
        np.testing.assert_array_equal(context[arm, arm * 6 : arm * 6 + 6], encoded)
        assert np.count_nonzero(np.delete(context[arm], range(arm * 6, arm * 6 + 6))) == 0
    correct = env.classes.index(targets[row])
    _, reward, terminated, truncated, step_info = env.step(correct)
    assert (reward, terminated, truncated, step_info["regret"]) == (1.0, False, False, 0.0)
    _, reward, *_ = env.step((env.classes.index(targets[env._row]) + 1) % 3)
    assert reward == 0.0


def test_bandit_from_in_memory_tables_and_vectorised() -> None:
    features = pd.DataFrame({"x": [0.0, 1.0, 2.0]})
    targets = pd.Series([1, 0, 1])
    env = make_bandit_env(BanditEnvSpec(num_envs=3), features=features, targets=targets)
    assert isinstance(env, SyncVectorEnv)
    contexts, _ = env.reset(seed=0)
    assert contexts.shape == (3, 2, 2)
    env.close()
    with pytest.raises(EnvBuildError, match="a bandit env needs `features` and `targets`"):
        make_bandit_env(BanditEnvSpec())
    with pytest.raises(EnvBuildError, match="bandit tables disagree: 3 feature rows, 2 targets"):
        make_bandit_env(BanditEnvSpec(), features=features, targets=targets[:2])
    with pytest.raises(EnvBuildError, match="targets: expected one column of classes, got 2"):
        make_bandit_env(
            BanditEnvSpec(),
            features=features,
            targets=pd.DataFrame({"a": [1, 0, 1], "b": [0, 0, 0]}),
        )
    with pytest.raises(
        EnvBuildError, match=r"features: expected a \.csv, \.jsonl, \.json or \.parquet file"
    ):
        make_bandit_env(BanditEnvSpec(features="f.xlsx", targets="t.csv"))
    single = make_bandit_env(BanditEnvSpec(), features=features, targets=targets)
    single.reset(seed=0)
    with pytest.raises(ValueError, match=r"action must be an arm in 0\.\.1, got 5"):
        single.step(5)


def test_offline_env_from_a_shipped_npz() -> None:
    offline = make_env(load_manifest(MANIFESTS / "offline_cartpole.yaml").env)
    try:
        assert isinstance(offline, OfflineEnv)
        assert len(offline) == 256
        assert offline.dataset["observations"].shape == (256, 4)
        assert offline.dataset["terminals"].dtype == np.bool_
        np.testing.assert_array_equal(
            offline.dataset["observations"][1:5], offline.dataset["next_observations"][0:4]
        )
        obs, _ = offline.env.reset(seed=0)
        assert obs.shape == (2, 4)
    finally:
        offline.close()


def test_offline_dataset_errors(tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    np.savez(path, observations=np.zeros((3, 4)), actions=np.zeros(3))
    with pytest.raises(
        EnvBuildError,
        match=r"lacks the arrays \['rewards', "
        r"'next_observations', 'terminals'\]",
    ):
        make_env(OfflineEnvSpec(name="CartPole-v1", dataset_path=str(path)))
    arrays = {k: np.zeros((3, 2)) for k in ("observations", "next_observations")}
    np.savez(path, **arrays, actions=np.zeros(3), rewards=np.zeros(3), terminals=np.zeros(3))
    with pytest.raises(
        EnvBuildError,
        match=r"observations have shape \(2,\) per row but env "
        r"'CartPole-v1' observes \(4,\)",
    ):
        make_env(OfflineEnvSpec(name="CartPole-v1", dataset_path=str(path), sync=True))
    np.savez(path, **arrays, actions=np.zeros(2), rewards=np.zeros(3), terminals=np.zeros(3))
    with pytest.raises(EnvBuildError, match="arrays of different lengths"):
        make_env(OfflineEnvSpec(name="CartPole-v1", dataset_path=str(path)))


def test_llm_specs_point_to_their_builders() -> None:
    with pytest.raises(
        AgileLLMEnvsError,
        match="is a rollout env: each trajectory gets its own "
        "env, so build a factory with make_rollout_env_factory",
    ):
        make_env(LLMEnvSpec(env_type="rollout", entrypoint="a:B"))


def test_pettingzoo_manifest_builds_an_async_vector_env_that_auto_resets() -> None:
    from agile_llmenvs.envs.examples import RendezvousEnv
    from agile_llmenvs.envs.pettingzoo_vec import AsyncPettingZooVecEnv

    manifest = load_manifest(MANIFESTS / "rendezvous_pettingzoo.yaml")
    env = make_env(manifest.env, multi_agent=manifest.multi_agent)
    try:
        assert isinstance(env, AsyncPettingZooVecEnv)
        assert env.num_envs == 4
        assert env.possible_agents == ["agent_0", "agent_1"]
        obs, _ = env.reset(seed=7)
        reference = RendezvousEnv(size=5, max_steps=10)
        for index in range(4):
            expected, _ = reference.reset(seed=7 + index)
            for agent in env.possible_agents:
                np.testing.assert_array_equal(obs[agent][index], expected[agent])
        stay = {agent: np.ones(4, dtype=np.int64) for agent in env.possible_agents}
        for _ in range(9):
            obs, rewards, terminations, truncations, infos = env.step(stay)
            assert truncations["agent_0"].tolist() == [False] * 4
        own, other = obs["agent_0"][:, 0], obs["agent_0"][:, 1]
        met = [float(a == b) for a, b in zip(own, other, strict=True)]  # staying never moves
        obs, rewards, terminations, truncations, infos = env.step(stay)  # step 10: truncated
        assert rewards["agent_0"].tolist() == met
        assert truncations["agent_1"].tolist() == [True] * 4
        assert terminations["agent_0"].tolist() == [False] * 4
        for index in range(4):
            assert infos["agent_0"][index]["_autoreset"] is True
            assert "final_observation" in infos["agent_0"][index]
    finally:
        env.close()
