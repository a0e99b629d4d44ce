"""Turn budgets of envs whose manifest sets no ``max_turns``: never silently one turn.

An env served by OpenEnv's own ``create_app`` advertises no budget (OpenEnv's ``State`` has no
``max_turns``), so building it from a manifest without one is an error naming
``env.max_turns``; with ``max_turns: 3`` its episodes last three turns. A GEM env built with
``factory: gem:make`` (which has no ``close``) declares its own budget, four turns.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serving import UvicornApp

from agile_llmenvs.envs import make_rollout_env_factory
from agile_llmenvs.errors import EnvBuildError
from agile_llmenvs.llm_envs import RolloutHarness, StopReason
from agile_llmenvs.llm_envs.from_spec import env_turn_budget
from agile_llmenvs.specs import LLMEnvSpec, load_manifest
from agile_llmenvs.transport._openenv import Action, Environment, Observation, State

EOS = 2  # <|im_end|> of the tiny model's tokenizer
FIRST = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # the first prompt's frame
NEXT = "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # after an <|im_end|>


class GuessAction(Action):
    """A guess at the secret fruit."""

    guess: str


class GuessObservation(Observation):
    """What the game says, and how many attempts are left."""

    text: str
    attempts_left: int


class GuessFruitEnv(Environment):
    """An OpenEnv-native game of three attempts at guessing ``plum``. Its state is OpenEnv's
    own ``State``, which has no ``max_turns``: the budget is in no place a client can read."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self.attempts_left = 3

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.attempts_left = 3
        return GuessObservation(text="Guess my fruit. You have 3 attempts.", attempts_left=3)

    def step(
        self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any
    ) -> GuessObservation:
        self._state.step_count += 1
        self.attempts_left -= 1
        left = self.attempts_left
        if action.guess.strip() == "plum":
            return GuessObservation(text="Right!", attempts_left=left, done=True, reward=1.0)
        return GuessObservation(
            text=f"Not {action.guess}. Attempts left: {left}.",
            attempts_left=left,
            done=left == 0,
            reward=0.0,
        )

    @property
    def state(self) -> State:
        return self._state


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def openenv_url() -> Iterator[str]:
    """The game served by OpenEnv's own ``create_app`` under uvicorn."""
    from openenv.core.env_server.http_server import create_app

    app = create_app(GuessFruitEnv, GuessAction, GuessObservation, max_concurrent_envs=4)
    with UvicornApp(app) as served:
        yield served.url


def manifest_env(tmp_path: Path, url: str, extra: str = "") -> LLMEnvSpec:
    """The env section of a manifest an OpenEnv user would write for the served game."""
    path = tmp_path / "remote.yaml"
    path.write_text(
        "env:\n"
        "  env_type: rollout\n"
        f"  env_url: {url}\n"
        "  action_field: guess\n"
        "  request_timeout_s: 10\n" + extra
    )
    spec = load_manifest(path).env
    assert isinstance(spec, LLMEnvSpec)
    return spec


def answer(tokenizer: Any, text: str) -> list[int]:
    return [*tokenizer.encode(text, add_special_tokens=False), EOS]


def unknown_budget(where: str) -> str:
    return (
        f"env.max_turns: {where} does not advertise a turn budget (its state has no "
        "`max_turns`), so an episode's length is unknown; set `max_turns` in the manifest's "
        "env section to the turns an episode may take (e.g. `max_turns: 3`)"
    )


def test_an_openenv_server_without_max_turns_is_an_error_naming_the_field(
    openenv_url: str, tmp_path: Path, tokenizer: Any
) -> None:
    spec = manifest_env(tmp_path, openenv_url)
    with pytest.raises(EnvBuildError) as built:
        make_rollout_env_factory(spec, tokenizer)
    assert str(built.value) == unknown_budget(f"the env at {openenv_url}")
    with pytest.raises(EnvBuildError) as one:
        RolloutHarness.from_spec(spec, tokenizer)
    assert str(one.value) == unknown_budget(f"the env at {openenv_url}")


def test_with_max_turns_3_an_openenv_episode_lasts_three_turns(
    openenv_url: str, tmp_path: Path, tokenizer: Any
) -> None:
    spec = manifest_env(tmp_path, openenv_url, "  max_turns: 3\n")
    factory, max_turns = make_rollout_env_factory(spec, tokenizer)
    assert max_turns == 3
    harness = factory()
    # the observation's one string field is the prompt, not the observation as JSON
    first = harness.reset()
    assert tokenizer.decode(first) == FIRST.format("Guess my fruit. You have 3 attempts.")
    texts = []
    for guess in ("apple", "pear", "fig"):
        result = harness.step(answer(tokenizer, guess))
        texts.append(tokenizer.decode(result.prompt_ids))
        assert result.reward == 0.0
    assert texts == [
        NEXT.format("Not apple. Attempts left: 2."),
        NEXT.format("Not pear. Attempts left: 1."),
        "",  # the third miss ends the game: no next prompt
    ]
    data = harness.get_episode_data()
    assert (data.num_turns, data.rewards) == (3, (0.0, 0.0, 0.0))
    assert data.stop_reason is StopReason.TERMINATED  # the env's own end, not the budget
    harness.close()

    # the manifest's budget is the one honoured: two turns, then the harness stops it
    short, _ = make_rollout_env_factory(spec.model_copy(update={"max_turns": 2}), tokenizer)
    harness = short()
    harness.reset()
    harness.step(answer(tokenizer, "apple"))
    assert harness.step(answer(tokenizer, "pear")).done
    assert harness.get_episode_data().stop_reason is StopReason.MAX_TURNS
    harness.close()


def test_an_openenv_env_in_process_without_max_turns_is_the_same_error(tokenizer: Any) -> None:
    entrypoint = f"{__name__}:GuessFruitEnv"
    spec = LLMEnvSpec(env_type="rollout", entrypoint=entrypoint, action_field="guess")
    with pytest.raises(EnvBuildError) as built:
        make_rollout_env_factory(spec, tokenizer)
    assert str(built.value) == unknown_budget(f"the OpenEnv env {entrypoint!r}")

    class Declared(GuessFruitEnv):
        max_turns = 3

    class SingleTurn:  # a text env that declares no budget is single-turn, by contract
        def reset(self, *, seed: int | None = None) -> tuple[str, dict[str, Any]]:
            return "Say hi.", {}

    assert env_turn_budget(Declared(), label="declared") == 3
    assert env_turn_budget(SingleTurn(), label="single") == 1


def test_gem_make_without_max_turns_plays_the_budget_gem_declares(tokenizer: Any) -> None:
    pytest.importorskip("gem", reason="needs the `envs` extra")
    spec = LLMEnvSpec(
        env_type="rollout", entrypoint="game:GuessTheNumber-v0-easy", factory="gem:make"
    )
    factory, max_turns = make_rollout_env_factory(spec, tokenizer)  # GEM's env has no close()
    assert max_turns == 4  # GuessTheNumber-v0-easy: a number in 1..10 within 4 turns
    harness = factory()
    prompt = tokenizer.decode(harness.reset(seed=0))
    assert prompt.startswith(
        "<|im_start|>user\nYou are playing Guess The Number.\nYou have to guess the number "
        "between 1 and 10 (inclusive) within 4 turns.\n"
    )
    texts = []
    for guess in (11, 12, 13, 14):  # out of range: never right, whatever the secret
        result = harness.step(answer(tokenizer, f"\\boxed{{{guess}}}"))
        texts.append(tokenizer.decode(result.prompt_ids))
    assert texts == [
        NEXT.format("At turn 1, you guessed 11, which is outside the range specified."),
        NEXT.format("At turn 2, you guessed 12, which is outside the range specified."),
        NEXT.format("At turn 3, you guessed 13, which is outside the range specified."),
        "",  # GEM ends the game at its fourth turn, truncated
    ]
    data = harness.get_episode_data()
    assert (data.num_turns, data.rewards) == (4, (0.0, 0.0, 0.0, 0.0))
    assert data.stop_reason is StopReason.TRUNCATED
    harness.close()
