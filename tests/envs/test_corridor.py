"""The key-and-door corridor: exact observations, rewards and ends, seeding, snapshots."""

from __future__ import annotations

import csv
import pickle
from pathlib import Path

import pytest

from agile_llmenvs.core import StepTuple, SupportsMaxTurns, SupportsSnapshot, TextEnv
from agile_llmenvs.envs.corridor import KEY_COLOURS, CorridorEnv, CorridorState
from agile_llmenvs.errors import EnvStateError
from agile_llmenvs.specs import LLMEnvSpec, ModelSpec, load_manifest

MANIFEST = Path(__file__).resolve().parents[2] / "manifests" / "grpo_corridor.yaml"
SEED = 0  # draws the blue key
START = (
    "You are in a corridor. A blue key lies at your feet. "
    "Say a digit to take the key. The door at the end opens only with the key."
)


def play(env: CorridorEnv, actions: list[str]) -> list[StepTuple]:
    return [env.step(action) for action in actions]


def test_the_corridor_satisfies_the_text_env_contract() -> None:
    env = CorridorEnv()
    assert isinstance(env, TextEnv)
    assert isinstance(env, SupportsMaxTurns)
    assert isinstance(env, SupportsSnapshot)
    assert env.max_turns == 4
    assert CorridorEnv.pure_step is True


def test_a_key_taker_opens_the_door_at_the_last_turn() -> None:
    env = CorridorEnv()
    assert env.reset(seed=SEED) == (START, {"colour": "blue"})
    observations, rewards, terminated, truncated, infos = zip(
        *play(env, ["take 7", "walk", "", "open"]), strict=True
    )
    assert observations == (
        "You walk down the corridor, step 1. You carry the blue key.",
        "You walk down the corridor, step 2. You carry the blue key.",
        "You reach the door. You carry the blue key.",
        "The door opens.",
    )
    assert rewards == (0.0, 0.0, 0.0, 1.0)
    assert terminated == (False, False, False, True)
    assert truncated == (False, False, False, False)
    assert infos == (*[{"has_key": True}] * 3, {"has_key": True, "success": True})


def test_a_key_leaver_finds_the_door_locked_whatever_it_says_later() -> None:
    env = CorridorEnv()
    env.reset(seed=SEED)
    # digits after the first turn take nothing: only the first turn decides
    observations, rewards, terminated, truncated, infos = zip(
        *play(env, ["no thanks", "1", "2", "3"]), strict=True
    )
    assert observations == (
        "You walk down the corridor, step 1. You have no key.",
        "You walk down the corridor, step 2. You have no key.",
        "You reach the door. You have no key.",
        "The door is locked.",
    )
    assert rewards == (0.0, 0.0, 0.0, 0.0)
    assert terminated == (False, False, False, True)
    assert truncated == (False, False, False, False)
    assert infos == (*[{"has_key": False}] * 3, {"has_key": False, "success": False})


def test_the_turn_count_is_configurable() -> None:
    env = CorridorEnv(max_turns=2)
    env.reset(seed=SEED)
    assert env.step("5") == (
        "You reach the door. You carry the blue key.",
        0.0,
        False,
        False,
        {"has_key": True},
    )
    assert env.step("x")[1:3] == (1.0, True)
    with pytest.raises(ValueError, match="at least 2"):
        CorridorEnv(max_turns=1)


def test_the_seed_picks_the_key_colour_and_nothing_else() -> None:
    env = CorridorEnv()
    colours = {env.reset(seed=seed)[1]["colour"] for seed in range(30)}
    assert colours == set(KEY_COLOURS)
    # the same situation reads the same in every episode: observations repeat
    assert env.reset(seed=SEED)[0] == CorridorEnv().reset(seed=SEED)[0] == START
    first = [env.step(a)[0] for a in ("9", "a", "b")]
    env.reset(seed=SEED)
    assert [env.step(a)[0] for a in ("4", "zz", "")] == first


def test_get_state_and_set_state_round_trip_mid_episode() -> None:
    env = CorridorEnv()
    env.reset(seed=SEED)
    env.step("3")
    state = env.get_state()
    assert state == CorridorState(colour="blue", turn=1, has_key=True)
    assert pickle.loads(pickle.dumps(state)) == state
    rest = play(env, ["a", "b", "c"])
    other = CorridorEnv()
    other.set_state(state)
    assert play(other, ["x", "y", "z"]) == rest  # the corridor's actions change nothing
    env.set_state(state)
    assert play(env, ["a", "b", "c"]) == rest


def test_calls_in_the_wrong_state_raise_named_errors() -> None:
    env = CorridorEnv(max_turns=2)
    with pytest.raises(EnvStateError, match="call reset"):
        env.step("1")
    env.reset(seed=SEED)
    play(env, ["1", "2"])
    assert env.get_state().turn == 2  # a finished episode may still be inspected
    with pytest.raises(EnvStateError, match="episode is over"):
        env.step("3")
    with pytest.raises(EnvStateError, match="CorridorState"):
        env.set_state(CorridorState(colour="red", turn=3))


def test_the_shipped_manifest_trains_two_steps(tmp_path: Path, tiny_model_dir: Path) -> None:
    from agile_llmenvs.training import train_grpo

    manifest = load_manifest(MANIFEST)
    assert isinstance(manifest.env, LLMEnvSpec)
    assert manifest.env.entrypoint == "agile_llmenvs.envs.corridor:CorridorEnv"
    assert manifest.training is not None
    assert manifest.training.credit == "turn_mc"
    update = {"max_steps": 2, "output_dir": str(tmp_path)}
    training = manifest.training.model_copy(update={**update, "tensorboard": False})
    model = ModelSpec(path=str(tiny_model_dir))
    train_grpo(manifest.model_copy(update={"training": training, "model": model}))
    with (tmp_path / "metrics.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert [row["step"] for row in rows] == ["1", "2"]
    assert all(0.0 <= float(row["reward_mean"]) <= 1.0 for row in rows)
    # turn_mc as shipped: s_1 of each of the 4 x 8 episodes valued (the env is pure: direct)
    assert [float(row["credit_states"]) for row in rows] == [32.0, 32.0]
    assert [float(row["credit_fallback_episodes"]) for row in rows] == [0.0, 0.0]
