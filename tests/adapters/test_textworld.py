"""TextWorld games as text envs: the walkthrough scores the max, seeds replay games, the
observation is the game's own text, branching by replay and fork, offline, the manifest."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from network_refused import REFUSE_NETWORK

from agile_llmenvs.branching import BranchManager
from agile_llmenvs.config.factories import EnvironmentFactory
from agile_llmenvs.config.models import EnvironmentConfig
from agile_llmenvs.core import Action, SupportsMaxTurns, TextEnv
from agile_llmenvs.errors import EnvBuildError
from agile_llmenvs.specs import LLMEnvSpec, ModelSpec, load_manifest

pytest.importorskip("textworld", reason="needs the `envs` extra")
import textworld

from agile_llmenvs.adapters.textworld import GameSettings, TextWorldEnv, generated_game, make

MANIFEST = Path(__file__).resolve().parents[2] / "manifests" / "grpo_textworld.yaml"
SETTINGS = GameSettings(world_size=2, nb_objects=3, quest_length=2)


@pytest.fixture(scope="module")
def games_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("textworld-games")


def play_walkthrough(
    env: TextWorldEnv, seed: int
) -> tuple[list[float], list[bool], dict[str, Any]]:
    """Reset with ``seed`` and answer each walkthrough command by its listed number."""
    env.reset(seed=seed)
    rewards, ends, info = [], [], {}
    for command in list(env.walkthrough):
        number = env.commands.index(command) + 1
        _, reward, terminated, truncated, info = env.step(f"{number}")
        assert not truncated
        rewards.append(reward)
        ends.append(terminated)
    return rewards, ends, info


def test_the_env_satisfies_the_text_env_contract(games_dir: Path) -> None:
    env = make(games_dir=str(games_dir), max_turns=5)
    assert isinstance(env, TextEnv)
    assert isinstance(env, SupportsMaxTurns)
    assert env.max_turns == 5


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_walkthrough_oracle_scores_the_max_score(games_dir: Path, seed: int) -> None:
    env = make(games_dir=str(games_dir), answer_by_number=True, games=None)
    rewards, ends, info = play_walkthrough(env, seed)
    # a 2-command quest of one reward point: the point is paid by the last command, which wins
    assert len(env.walkthrough) == 2
    assert env.max_score == 1.0
    assert rewards == [0.0, 1.0]
    assert ends == [False, True]
    assert info["won"] is True
    assert info["score"] == 1.0
    env.close()


def test_the_game_is_the_one_tw_make_custom_makes_from_the_seed(
    games_dir: Path, tmp_path: Path
) -> None:
    tw_make = Path(sys.executable).parent / "tw-make"
    out = tmp_path / "made.z8"
    options = ["--world-size", "2", "--nb-objects", "3", "--quest-length", "2", "--seed", "1"]
    subprocess.run(
        [str(tw_make), "custom", *options, "--output", str(out), "-f", "--silent"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    ours = json.loads(generated_game(SETTINGS, 1, games_dir).with_suffix(".json").read_text())
    theirs = json.loads(out.with_suffix(".json").read_text())
    assert ours["metadata"]["walkthrough"] == theirs["metadata"]["walkthrough"]
    assert ours["world"] == theirs["world"]
    assert ours["objective"] == theirs["objective"]


@pytest.mark.filterwarnings("ignore:.*is not fully supported")
def test_the_observation_is_the_games_own_text_and_its_numbered_commands(games_dir: Path) -> None:
    env = make(games_dir=str(games_dir), answer_by_number=True, games=4)
    observation, info = env.reset(seed=5)  # 5 % 4: the game of seed 1
    path = games_dir / SETTINGS.key / "game-1.z8"
    assert info == {"max_score": 1.0, "game": str(path)}
    infos = textworld.EnvInfos(objective=True, description=True, admissible_commands=True)
    game = textworld.start(str(path), request_infos=infos)
    state = game.reset()
    listed = "\n".join(f"{n}. {c}" for n, c in enumerate(state.admissible_commands, 1))
    description = "\n\n".join(part for part in state.description.split("\n\n") if part.strip())
    assert observation == (
        f"{state.objective}\n\n{description}\n\nCommands (answer with a number):\n{listed}"
    )
    assert env.commands == state.admissible_commands
    first = env.walkthrough[0]
    text, reward, terminated, _, step_info = env.step(f"I choose {env.commands.index(first) + 1}")
    state, _, _ = game.step(first)
    assert step_info == {"command": first, "score": 0.0, "won": False}
    assert (reward, terminated) == (0.0, False)
    feedback = state.feedback.split("\n>")[0].strip()  # the game's prompt line left out
    assert text.startswith(feedback)
    assert text.endswith("\n".join(f"{n}. {c}" for n, c in enumerate(state.admissible_commands, 1)))
    game.close()
    env.close()


def test_a_number_that_lists_no_command_is_answered_without_a_move(games_dir: Path) -> None:
    env = make(games_dir=str(games_dir), answer_by_number=True, games=4)
    env.reset(seed=1)
    commands = list(env.commands)
    for reply in ("no number", "0", f"{len(commands) + 1}"):
        text, reward, terminated, truncated, info = env.step(reply)
        assert text.startswith(f"Answer with the number of a command, 1 to {len(commands)}.\n")
        assert (reward, terminated, truncated, info) == (0.0, False, False, {"invalid": True})
    assert env.commands == commands
    # by text: the game's own parser answers a command it does not know
    worded = make(games_dir=str(games_dir), games=4)
    worded.reset(seed=1)
    text, reward, terminated, _, info = worded.step("  dance wildly ")
    assert info["command"] == "dance wildly"
    assert (reward, terminated) == (0.0, False)
    assert text.startswith("That's not a verb I recognise.")
    assert "\n\nCommands: " in text


def test_a_seeded_reset_replays_the_same_game(games_dir: Path, tmp_path: Path) -> None:
    """Two envs, one of them generating into a folder of its own, play the same seed alike."""

    def episode(env: TextWorldEnv) -> list[Any]:
        seen: list[Any] = [env.reset(seed=6)[0]]
        for reply in ("2", "1", "3"):
            seen.append(env.step(reply)[:3])
        return seen

    first = make(games_dir=str(games_dir), answer_by_number=True, games=4)
    second = make(games_dir=str(tmp_path), answer_by_number=True, games=4)
    assert episode(first) == episode(second)
    assert episode(first) == episode(first)  # and the same env again, after its own game
    other = make(games_dir=str(games_dir), answer_by_number=True, games=4)
    assert other.reset(seed=7)[0] != first.reset(seed=6)[0]  # seed 3's game is another


@pytest.mark.parametrize("strategy", ["action_replay", "process_fork"])
def test_an_episode_branches_mid_game(games_dir: Path, strategy: str) -> None:
    env_config = {"games_dir": str(games_dir), "answer_by_number": True, "games": 4}
    config = EnvironmentConfig(
        name="tw",
        source="entry_point",
        entry_point="agile_llmenvs.adapters.textworld:make",
        env_config=env_config,
    )
    env = EnvironmentFactory.create(config)
    oracle = make(**env_config)  # type: ignore[arg-type]
    oracle.reset(seed=1)
    first, second = oracle.walkthrough

    def number(command: str, commands: list[str]) -> Action:
        return Action.from_text(f"{commands.index(command) + 1}")

    state, _ = env.reset(seed=1)
    action = number(first, oracle.commands)
    oracle.step(action.text)
    after = env.step(state, action).next_state
    factory = lambda: EnvironmentFactory.create(config)  # noqa: E731
    with BranchManager.create(env, strategy=strategy, env_factory=factory) as manager:  # type: ignore[arg-type]
        assert manager.strategy_name == strategy
        manager.checkpoint("after-first", after, (action,), {"seed": 1})
        for _ in range(2):
            branch_env, branch_state = manager.branch("after-first")
            result = branch_env.step(branch_state, number(second, oracle.commands))
            assert (result.reward, result.terminated) == (1.0, True)
        wrong = next(c for c in oracle.commands if c not in (first, second))
        result = env.step(after, number(wrong, oracle.commands))  # the original plays on
        assert (result.reward, result.terminated) == (0.0, False)


OFFLINE_PLAY = (
    REFUSE_NETWORK
    + """
import sys
from agile_llmenvs.adapters.textworld import make
env = make(games_dir=sys.argv[1], answer_by_number=True, games=None, first_seed=40)
env.reset(seed=0)  # a game never made before: generated here
env.step("1")
env.close()
print("attempts", attempts)
"""
)


def test_generating_and_playing_stay_offline(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", OFFLINE_PLAY, str(tmp_path)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "attempts []"
    assert sorted(p.name for p in (tmp_path / SETTINGS.key).iterdir()) == [
        "game-40.json",
        "game-40.z8",
    ]


def test_bad_settings_are_refused_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(EnvBuildError, match=r"^textworld: quest_length must be at least 1, got 0$"):
        make(quest_length=0)
    with pytest.raises(
        EnvBuildError, match=r"^textworld: games must be at least 1 or null, got 0$"
    ):
        make(games=0)
    with pytest.raises(EnvBuildError, match=r"^textworld: no game file at .*missing\.z8$"):
        make(str(tmp_path / "missing.z8"))
    with pytest.raises(EnvBuildError, match=r"^textworld: answer_by_number needs list_commands"):
        make(answer_by_number=True, list_commands=False)


def test_validate_builds_the_shipped_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from agile_llmenvs.cli import main

    assert main(["validate", str(MANIFEST)]) == 0
    assert capsys.readouterr().out.startswith(f"ok    {MANIFEST}: run 'textworld'")
    bad = tmp_path / "bad.yaml"
    bad.write_text(MANIFEST.read_text().replace("quest_length: 2", "quest_length: 0"))
    assert main(["validate", str(bad)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error {bad}: run manifest, 1 problem(s)",
        "  env.entrypoint: textworld: quest_length must be at least 1, got 0",
    ]


def test_the_shipped_manifest_trains_a_step_with_tree(tmp_path: Path, tiny_model_dir: Path) -> None:
    from agile_llmenvs.training import train_grpo

    manifest = load_manifest(MANIFEST)
    assert isinstance(manifest.env, LLMEnvSpec)
    assert manifest.training is not None
    assert manifest.training.credit == "tree"
    assert manifest.training.credit_branching == "action_replay"
    update = {
        "max_steps": 1,
        "batch_size": 2,
        "group_size": 4,
        "output_dir": str(tmp_path),
        "tensorboard": False,
    }
    training = manifest.training.model_copy(update=update)
    model = ModelSpec(path=str(tiny_model_dir))
    train_grpo(manifest.model_copy(update={"training": training, "model": model}))
    with (tmp_path / "metrics.csv").open(newline="") as file:
        (row,) = list(csv.DictReader(file))
    assert (row["step"], row["failed_episodes"]) == ("1", "0")
    assert float(row["credit_fallback_episodes"]) == 0.0
    # a 2-command quest takes 2 turns at least: every one of the 2 x 4 episodes has a state
    # after its first turn to branch from, and one continuation (credit_rollouts: 1) from each
    assert float(row["credit_states"]) >= 8.0
