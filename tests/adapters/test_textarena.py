"""TextArena games through the rollout factory and the collector: scripted policies that win,
rewards paid on the terminal step within the game's own turn limit, only new messages passed
on each turn, seeded replays, and no thread left behind."""

from __future__ import annotations

import itertools
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from network_refused import REFUSE_NETWORK

from agile_llmenvs.envs import make_rollout_env_factory
from agile_llmenvs.llm_envs import RolloutCollector, StopReason
from agile_llmenvs.specs import LLMEnvSpec

pytest.importorskip("textarena", reason="needs the `envs` extra")
from agile_llmenvs.adapters.textarena import TextArenaEnv, make

EOS = 2
GUESS_PROMPT = "You are playing Guess The Number"
LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]


@pytest.fixture
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def spec(game: str, **env_config: Any) -> LLMEnvSpec:
    return LLMEnvSpec(
        env_type="rollout",
        entrypoint=game,
        factory="agile_llmenvs.adapters.textarena:make",
        env_config=env_config,
    )


def scripted(tokenizer: Any, policy: Callable[[str], str], seen: list[str]) -> Any:
    """A collector ``generate`` that plays ``policy`` on each slot's decoded context."""

    def generate(contexts: list[list[int]]) -> list[list[int]]:
        texts = [tokenizer.decode(ids) for ids in contexts]
        seen.extend(texts)
        return [[*tokenizer.encode(policy(t), add_special_tokens=False), EOS] for t in texts]

    return generate


def collect(
    tokenizer: Any, game_spec: LLMEnvSpec, policy: Callable[[str], str], base_seed: int = 7
) -> Any:
    factory, max_turns = make_rollout_env_factory(game_spec, tokenizer)
    seen: list[str] = []
    before = set(threading.enumerate())
    collector = RolloutCollector(factory, batch_size=2, group_size=2, base_seed=base_seed)
    try:
        batch = collector.collect(scripted(tokenizer, policy, seen))
    finally:
        collector.close()
    for thread in set(threading.enumerate()) - before:  # the collector's pool, told to exit
        thread.join(timeout=10)
    assert set(threading.enumerate()) <= before
    return batch, max_turns, seen


def binary_search(context: str) -> str:
    low, high = 1, 20
    for hint in re.findall(r"The target number is (lower|higher)\.", context):
        guess = (low + high) // 2
        low, high = (low, guess - 1) if hint == "lower" else (guess + 1, high)
    return f"[{(low + high) // 2}]"


def mastermind_solver(context: str) -> str:
    """The first code consistent with every feedback so far (4 distinct digits of 1-6)."""
    feedback = re.findall(
        r"Submitted \[([\d ]+)\]\. Feedback: (\d) black peg\(s\), (\d) white", context
    )
    for code in itertools.permutations(range(1, 7), 4):
        if all(pegs(code, tuple(map(int, g.split()))) == (int(b), int(w)) for g, b, w in feedback):
            return "[" + " ".join(map(str, code)) + "]"
    raise AssertionError("no consistent code")


def pegs(code: tuple[int, ...], guess: tuple[int, ...]) -> tuple[int, int]:
    black = sum(c == g for c, g in zip(code, guess, strict=True))
    return black, len(set(code) & set(guess)) - black


def tic_tac_toe(context: str) -> str:
    """Win if a move wins, block if the opponent threatens, else centre, corner, any."""
    board = context.rsplit("Current Board:", 1)[1].split("Available Moves:")[0]
    cells = re.findall(r"\s([XO\d])\s", board.replace("|", " "))[:9]
    free = [i for i, c in enumerate(cells) if c.isdigit()]
    for mark in ("O", "X"):  # the policy, player 0, is O
        for line in LINES:
            marks = [cells[i] for i in line]
            if marks.count(mark) == 2 and any(cells[i].isdigit() for i in line):
                return f"[{next(i for i in line if cells[i].isdigit())}]"
    for cell in (4, 0, 2, 6, 8):
        if cell in free:
            return f"[{cell}]"
    return f"[{free[0]}]"


def test_guess_the_number_binary_search_wins_passing_only_new_messages(tokenizer: Any) -> None:
    batch, max_turns, seen = collect(tokenizer, spec("GuessTheNumber-v0"), binary_search)
    assert max_turns == 22  # the game's 10 turns (+1, see below), each forgiving an invalid move
    for trajectory in batch.trajectories:
        episode = trajectory.episode
        assert episode.stop_reason is StopReason.TERMINATED
        assert episode.rewards == (0.0,) * (len(episode.rewards) - 1) + (1.0,)
        assert 1 < len(episode.rewards) <= 5
    for context in seen:  # each message once: the prompt, then one hint per guess
        assert context.count(GUESS_PROMPT) == 1
        assert context.count("The target number is") == context.count("<|im_start|>user") - 1


def test_mastermind_consistent_guesses_win(tokenizer: Any) -> None:
    batch, max_turns, _ = collect(tokenizer, spec("Mastermind-v0"), mastermind_solver)
    assert max_turns == 42
    for trajectory in batch.trajectories:
        assert trajectory.episode.stop_reason is StopReason.TERMINATED
        assert trajectory.episode.rewards[-1] == 1.0
        assert set(trajectory.episode.rewards[:-1]) <= {0.0}


def test_tic_tac_toe_against_the_random_opponent_replays_by_seed(tokenizer: Any) -> None:
    game = spec("TicTacToe-v0")
    first, max_turns, seen = collect(tokenizer, game, tic_tac_toe, base_seed=6)
    _, _, seen_again = collect(tokenizer, game, tic_tac_toe, base_seed=6)
    assert max_turns == 100  # TicTacToe declares no limit
    assert seen == seen_again  # the same opponent moves for the same seeds
    assert [t.episode.rewards for t in first.trajectories] == [
        (0.0, 0.0, 1.0),
        (0.0, 0.0, 1.0),
        (0.0, 0.0, 0.0, 1.0),
        (0.0, 0.0, 0.0, 1.0),
    ]
    for context in seen:  # one board per move: the policy's, then the opponent's
        assert context.count("Current Board:") == 2 * context.count("<|im_start|>user") - 1


@pytest.mark.parametrize(
    ("moves", "rewards"),
    [((3, 4, 5), (0.0, 0.0, 1.0)), ((8, 7, 3), (0.0, 0.0, -1.0))],
)
def test_tic_tac_toe_pays_the_winner_on_the_terminal_step(
    tokenizer: Any, moves: tuple[int, ...], rewards: tuple[float, ...]
) -> None:
    factory, _ = make_rollout_env_factory(spec("TicTacToe-v0", opponent="first"), tokenizer)
    harness = factory()
    harness.reset(seed=0)
    for move in moves:  # the opponent plays 0, 1, 2, ...: row 0-1-2 wins on its third move
        result = harness.step([*tokenizer.encode(f"[{move}]", add_special_tokens=False), EOS])
    assert result.done
    data = harness.get_episode_data()
    assert data.rewards == rewards
    assert data.stop_reason is StopReason.TERMINATED
    harness.close()


def test_the_game_turn_limit_ends_with_its_reward_on_the_last_step() -> None:
    env = make("GuessTheNumber-v0")
    env.reset(seed=3)
    target = env.game.state.game_state["game_number"]
    guesses = [n for n in range(1, 21) if n != target][:11]
    steps = [env.step(f"[{n}]") for n in guesses]
    # GuessTheNumber-v0 says 10 turns but checks its limit before counting the turn: the 11th
    # guess ends it, one the env's budget (22: 11 turns, each forgiving an invalid move) allows
    assert env.max_turns == 22
    assert [s[2] for s in steps] == [False] * 10 + [True]
    assert [s[1] for s in steps[:10]] == [0.0] * 10
    assert steps[-1][1] == pytest.approx(1 - abs(guesses[-1] - target) / 19)
    assert "The turn limit has been reached" in steps[-1][0]
    assert "The target number is" in steps[-1][0]
    assert GUESS_PROMPT not in steps[-1][0]


def test_reset_with_a_seed_replays_whatever_else_draws_randomness() -> None:
    def play(env: TextArenaEnv) -> list[str]:
        return [env.step(f"[{n}]")[0] for n in (10, 5, 15)]

    first, second = make("GuessTheNumber-v0"), make("GuessTheNumber-v0")
    first.reset(seed=11)
    random.seed(99)
    second.reset(seed=11)
    random.random()
    assert play(first) == play(second)
    assert first.game.state.game_state["game_number"] == second.game.state.game_state["game_number"]


OFFLINE_BUILD = (
    REFUSE_NETWORK
    + """
from agile_llmenvs.adapters.textarena import make

for game in ("GuessTheNumber-v0", "Mastermind-v0", "TicTacToe-v0"):
    env = make(game)
    env.reset(seed=0)
    env.step("[1]")
    env.close()
print("attempts", attempts)
"""
)


def test_import_and_games_stay_offline() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", OFFLINE_BUILD], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "attempts []"


def test_unseeded_resets_play_different_games() -> None:
    targets = set()
    for _ in range(10):
        env = make("GuessTheNumber-v0")
        env.reset()
        targets.add(env.game.state.game_state["game_number"])
    assert len(targets) > 1  # all ten alike: once in 20**9


def model_opponent(tiny_model_dir: Path) -> dict[str, Any]:
    return {
        "backend": "huggingface",
        "model": str(tiny_model_dir),
        "sampling": {"max_tokens": 6},
        "system_prompt": "You play Tic Tac Toe. Answer with a move such as [4].",
    }


def test_a_second_model_plays_the_opponent_from_the_manifest(tiny_model_dir: Path) -> None:
    """The opponent's moves are the tiny model's greedy replies to its own side of the game:
    the text a fresh backend generates for the conversation the opponent was shown."""
    from agile_llmenvs.adapters.textarena import ModelPlayer
    from agile_llmenvs.backends import HFBackend, SamplingParams
    from agile_llmenvs.transport.resolve import env_factory

    before = set(threading.enumerate())
    game = spec("TicTacToe-v0", opponent=model_opponent(tiny_model_dir))
    assert game.entrypoint is not None
    make_env = env_factory(game.entrypoint, game.env_config, factory=game.factory)
    env = make_env()
    opponent = env.opponent
    assert isinstance(opponent, ModelPlayer)
    assert opponent.sampling == SamplingParams(max_tokens=6, temperature=0.0)
    env.reset(seed=0)
    played, steps = [], []
    for move in ("[4]", "[0]", "[2]", "[6]", "[8]", "[1]", "[3]", "[5]", "[7]"):
        steps.append(env.step(move))
        played.extend(steps[-1][4]["opponent_moves"])
        if steps[-1][2]:
            break
    assert steps[-1][2]  # the game ended, and paid the policy on its last step
    assert steps[-1][1] == 1.0  # the random tiny model writes no move: two invalid ones forfeit
    assert [s[1] for s in steps[:-1]] == [0.0] * (len(steps) - 1)
    shown = list(opponent._messages)
    assert played
    assert played == opponent.moves
    assert [m["content"] for m in shown if m["role"] == "assistant"] == played
    assert shown[0] == {
        "role": "system",
        "content": model_opponent(tiny_model_dir)["system_prompt"],
    }
    assert "Current Board" in shown[1]["content"]
    env.close()
    assert make_env().opponent.backend is opponent.backend  # built once per process

    backend = HFBackend(tiny_model_dir)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    for turn, move in enumerate(played):  # the system prompt, then each board and reply
        assert backend.generate_chat(shown[: 2 + 2 * turn], greedy).text == move
    backend.close()
    assert set(threading.enumerate()) <= before


def test_a_backend_object_plays_the_opponent() -> None:
    from agile_llmenvs.backends import Completion, SamplingParams

    class Echo:
        """A Backend that plays the last cell the game lists; it records what it was asked."""

        def __init__(self) -> None:
            self.asked: list[Any] = []

        def generate_chat(self, messages: Any, params: Any) -> Completion:
            self.asked.append((list(messages), params))
            return Completion(text=re.findall(r"\[\d\]", messages[-1]["content"])[-1])

        def close(self) -> None:
            pass

    backend = Echo()
    env = make("TicTacToe-v0", opponent=backend)
    env.reset(seed=0)
    observation, *_, step_info = env.step("[4]")
    assert step_info["opponent_moves"] == ["[8]"]  # the last free cell after the policy's 4
    ((messages, params),) = backend.asked
    assert [m["role"] for m in messages] == ["user"]
    assert params == SamplingParams(max_tokens=64, temperature=0.0)
    assert "[Player 1] [8]" in observation


def recorded_moves(env: TextArenaEnv) -> list[str]:
    """The actions the game parses from now on, every seat's, in order."""
    parsed: list[str] = []
    real = env.game.step

    def step(action: str) -> Any:
        parsed.append(action)
        return real(action=action)

    env.game.step = step  # type: ignore[method-assign]
    return parsed


def test_a_reply_longer_than_max_action_chars_reaches_the_game_cut_to_its_end() -> None:
    """ConnectFour's move pattern backtracks: a 32,000-character ``[[[...`` reply froze the
    process for 19 s. The game now parses the reply's last 2,000 characters, where a
    reasoning reply writes its move."""
    env = make("ConnectFour-v0")
    parsed = recorded_moves(env)
    env.reset(seed=0)
    reply = "[" * 32_000 + " my move: [col 3]"
    env.step(reply)
    assert parsed[0] == reply[-2000:]
    assert parsed[0].endswith("[col 3]")
    assert env.max_action_chars == 2000
    assert make("ConnectFour-v0", max_action_chars=50).max_action_chars == 50


def test_an_opponent_answering_a_megabyte_is_cut_as_the_policy_is() -> None:
    """A model opponent that answers 1 MB: the game parses its last ``max_action_chars``
    characters (its move), and the episode's info keeps no more than that."""
    junk = "[" * 1_000_000

    def verbose(observation: str) -> str:
        return f"{junk} my move: [col 0]"

    env = make("ConnectFour-v0", opponent=verbose)
    parsed = recorded_moves(env)
    env.reset(seed=0)
    start = time.monotonic()
    _, _, _, _, info = env.step("[col 3]")
    assert time.monotonic() - start < 5.0
    [move] = info["opponent_moves"]
    assert len(move) == 2000
    assert move == f"{junk} my move: [col 0]"[-2000:]
    assert parsed == ["[col 3]", move]


def test_an_opponent_whose_backend_fails_fails_the_step_naming_it() -> None:
    """An API opponent past its retries or deadline returns a failed completion: the step
    raises ``EnvExecutionError`` (the collector ends that episode as an env error; the
    others play on), never a move made of the error text."""
    from agile_llmenvs.backends import Completion
    from agile_llmenvs.errors import EnvExecutionError

    class Down:
        def generate_chat(self, messages: Any, params: Any) -> Completion:
            return Completion.failed("no answer within timeout_s=3 s, the deadline of the call")

        def close(self) -> None:
            pass

    env = make("TicTacToe-v0", opponent=Down())
    env.reset(seed=0)
    with pytest.raises(EnvExecutionError) as raised:
        env.step("[4]")
    assert str(raised.value) == (
        "textarena: the opponent's backend failed: no answer within timeout_s=3 s, the "
        "deadline of the call"
    )
