"""The every-turn task: exact observations, rewards and ends, snapshots, the shipped manifest."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from agile_llmenvs.core import SupportsMaxTurns, SupportsSnapshot, TextEnv
from agile_llmenvs.envs.every_turn import EveryTurnEnv, EveryTurnState
from agile_llmenvs.errors import EnvStateError
from agile_llmenvs.specs import LLMEnvSpec, ModelSpec, load_manifest

MANIFEST = Path(__file__).resolve().parents[2] / "manifests" / "grpo_every_turn.yaml"


def test_the_env_satisfies_the_text_env_contract() -> None:
    env = EveryTurnEnv()
    assert isinstance(env, TextEnv)
    assert isinstance(env, SupportsMaxTurns)
    assert isinstance(env, SupportsSnapshot)
    assert env.max_turns == 4
    assert EveryTurnEnv.pure_step is True
    with pytest.raises(ValueError, match="max_turns must be at least 1, got 0"):
        EveryTurnEnv(0)


def test_a_digit_at_every_turn_scores_one_at_the_last_turn() -> None:
    env = EveryTurnEnv()
    assert env.reset(seed=3) == ("Turn 1 of 4: say a digit.", {})
    steps = [env.step(action) for action in ["1", "a 2", "33", "x9y"]]
    assert steps == [
        ("Turn 2 of 4: say a digit.", 0.0, False, False, {}),
        ("Turn 3 of 4: say a digit.", 0.0, False, False, {}),
        ("Turn 4 of 4: say a digit.", 0.0, False, False, {}),
        ("Done: every turn said a digit.", 1.0, True, False, {"success": True}),
    ]


@pytest.mark.parametrize("wrong", [0, 1, 2, 3])
def test_one_turn_without_a_digit_anywhere_ruins_the_episode(wrong: int) -> None:
    env = EveryTurnEnv()
    env.reset()
    actions = ["no" if turn == wrong else "7" for turn in range(4)]
    steps = [env.step(action) for action in actions]
    # the observations do not tell: they are the same as a perfect episode's
    assert [s[0] for s in steps[:3]] == [f"Turn {t} of 4: say a digit." for t in (2, 3, 4)]
    assert [s[1] for s in steps] == [0.0, 0.0, 0.0, 0.0]
    assert steps[-1][2:] == (True, False, {"success": False})


def test_a_snapshot_restores_the_episode() -> None:
    env = EveryTurnEnv(3)
    env.reset()
    env.step("no")
    state = env.get_state()
    assert state == EveryTurnState(turn=1, intact=False)
    env.set_state(EveryTurnState(turn=1, intact=True))
    env.step("1")
    assert env.step("2")[1:3] == (1.0, True)
    env.set_state(state)
    env.step("1")
    assert env.step("2")[1:3] == (0.0, True)
    with pytest.raises(EnvStateError, match="episode is over"):
        env.step("3")
    with pytest.raises(EnvStateError, match=r"EveryTurnState with turn in 0\.\.3"):
        env.set_state(EveryTurnState(turn=4))


def test_the_shipped_manifest_trains_two_steps_with_tree(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from agile_llmenvs.training import train_grpo

    manifest = load_manifest(MANIFEST)
    assert isinstance(manifest.env, LLMEnvSpec)
    assert manifest.env.entrypoint == "agile_llmenvs.envs.every_turn:EveryTurnEnv"
    assert manifest.training is not None
    assert manifest.training.credit == "tree"
    update = {"max_steps": 2, "output_dir": str(tmp_path), "tensorboard": False}
    training = manifest.training.model_copy(update=update)
    model = ModelSpec(path=str(tiny_model_dir))
    train_grpo(manifest.model_copy(update={"training": training, "model": model}))
    with (tmp_path / "metrics.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert [row["step"] for row in rows] == ["1", "2"]
    # s_1, s_2 and s_3 of each of the 4 x 8 episodes valued (the env is pure: direct)
    assert [float(row["credit_states"]) for row in rows] == [96.0, 96.0]
    assert [float(row["credit_fallback_episodes"]) for row in rows] == [0.0, 0.0]
