"""Typed actions (#34): text the env's action class refuses is an invalid turn, not a failure.

An OpenEnv env whose action has an ``int`` field is played through
``make_rollout_env_factory`` and the ``RolloutCollector``, in this process and served by a
real ``OpenEnvServer``: a turn whose text is no ``int`` shows the policy which field was wrong
and why, scores ``invalid_action_reward``, and the episode goes on; an exception of the env
itself still fails its episode.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import typed_envs
from pydantic import ValidationError

from agile_llmenvs.core import RolloutBatch
from agile_llmenvs.envs import make_rollout_env_factory
from agile_llmenvs.llm_envs import OpenEnvServer, RolloutCollector, StopReason
from agile_llmenvs.llm_envs.actions import INVALID_ACTION_FEEDBACK
from agile_llmenvs.specs import LLMEnvSpec

EOS = 2
NOT_AN_INT = "guess: Input should be a valid integer, unable to parse string as an integer"
NOT_AN_INT_FEEDBACK = (
    "Error: your action is not valid: guess: Input should be a valid integer, unable to parse "
    "string as an integer"
)


@pytest.fixture(params=["in_process", "served"])
def env_fields(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The typed env's manifest fields: built in this process, or served on 127.0.0.1."""
    fields: dict[str, Any] = {"env_type": "rollout", "action_field": "guess", "max_turns": 3}
    if request.param == "in_process":
        yield {**fields, "entrypoint": "typed_envs:IntGuessEnvironment"}
        return
    with OpenEnvServer(make_env=typed_envs.IntGuessEnvironment, max_concurrent_envs=8) as server:
        yield {**fields, "env_url": server.url, "request_timeout_s": 30}


def play(
    tokenizer: Any, fields: dict[str, Any], choose: Callable[[str], str], group: int = 2
) -> RolloutBatch:
    """One batch of one group, the policy answering each context's text with ``choose``."""
    spec = LLMEnvSpec.model_validate(fields)
    factory, _ = make_rollout_env_factory(spec, tokenizer)

    def generate(contexts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        out = []
        for context in contexts:
            ids = [*tokenizer.encode(choose(tokenizer.decode(context)), add_special_tokens=False)]
            out.append(([*ids, EOS], [-0.5] * (len(ids) + 1)))
        return out

    collector = RolloutCollector(factory, batch_size=1, group_size=group, base_seed=0)
    try:
        return collector.collect(generate)
    finally:
        collector.close()


def seven_once_told(text: str) -> str:
    """Garbage first; ``7`` once the context shows the invalid-action feedback."""
    return "7" if "not valid" in text else "seven"


def test_text_that_is_no_int_is_an_invalid_turn_and_the_episode_goes_on(
    tokenizer: Any, env_fields: dict[str, Any]
) -> None:
    batch = play(tokenizer, env_fields, seven_once_told)
    assert batch.failed == 0
    for trajectory in batch.trajectories:
        episode = trajectory.episode
        assert episode.stop_reason is StopReason.TERMINATED
        assert episode.rewards == (0.0, 1.0)
        assert episode.info["invalid_action"] == NOT_AN_INT
        [sample] = episode.samples
        text = tokenizer.decode(sample.token_ids)
        assert text.count(NOT_AN_INT_FEEDBACK) == 1
        # the feedback is what the policy read before its second, valid answer
        assert text.index("seven") < text.index(NOT_AN_INT_FEEDBACK) < text.rindex("7")
    assert INVALID_ACTION_FEEDBACK.format(reason=NOT_AN_INT) == NOT_AN_INT_FEEDBACK


def test_invalid_turns_score_the_penalty_and_count_against_max_turns(
    tokenizer: Any, env_fields: dict[str, Any]
) -> None:
    fields = {**env_fields, "invalid_action_reward": -0.5}
    batch = play(tokenizer, fields, lambda text: "seven")
    assert batch.failed == 0
    for trajectory in batch.trajectories:
        assert trajectory.episode.stop_reason is StopReason.MAX_TURNS
        assert trajectory.episode.rewards == (-0.5, -0.5, -0.5)


@pytest.mark.parametrize("guess", ["13", "-1"])
def test_an_exception_of_the_env_itself_still_fails_the_episode(
    tokenizer: Any, env_fields: dict[str, Any], guess: str
) -> None:
    # 13: the env raises; -1: the env's own pydantic model refuses a value (its bug too)
    batch = play(tokenizer, env_fields, lambda text: guess)
    assert batch.failed == 2
    for trajectory in batch.trajectories:
        assert trajectory.episode.stop_reason is StopReason.ENV_ERROR
        assert "invalid_action" not in trajectory.episode.info
    error = batch.trajectories[0].episode.info["error"]
    assert ("unlucky number" if guess == "13" else "ValidationError") in error


def test_an_action_field_the_action_class_lacks_is_a_failure_not_an_invalid_turn(
    tokenizer: Any, env_fields: dict[str, Any]
) -> None:
    # the text sent as `message`: a manifest mistake the policy cannot fix, so it fails loudly
    fields = {k: v for k, v in env_fields.items() if k != "action_field"}
    batch = play(tokenizer, fields, lambda text: "7")
    assert batch.failed == 2
    error = batch.trajectories[0].episode.info["error"]
    assert "guess\n  Field required" in error
    assert "message\n  Extra inputs are not permitted" in error


@pytest.mark.parametrize("target", ["module", "file"])
def test_an_action_parser_makes_the_fields_and_its_value_error_is_the_feedback(
    tokenizer: Any, env_fields: dict[str, Any], target: str
) -> None:
    parser = (
        "typed_envs:parse_guess"
        if target == "module"
        else f"{Path(typed_envs.__file__).resolve()}:parse_guess"
    )
    fields = {**env_fields, "action_parser": parser, "invalid_action_reward": -0.25}
    # no tags, then a guess that is no number, then a right one
    answers = {0: "7", 1: "<guess>x</guess>", 2: "<guess>7</guess>"}
    batch = play(tokenizer, fields, lambda text: answers[text.count("write your guess")], group=1)
    assert batch.failed == 0
    [trajectory] = batch.trajectories
    episode = trajectory.episode
    assert episode.stop_reason is StopReason.TERMINATED
    assert episode.rewards == (-0.25, -0.25, 1.0)
    assert episode.info["invalid_action"] == "write your guess as <guess>N</guess>"
    text = tokenizer.decode(episode.samples[0].token_ids)
    assert text.count("Error: your action is not valid: write your guess as <guess>N</guess>") == 2


def test_a_parsed_action_the_action_class_refuses_is_an_invalid_turn(
    tokenizer: Any, env_fields: dict[str, Any]
) -> None:
    fields = {**env_fields, "action_parser": "typed_envs:parse_as_text"}
    batch = play(tokenizer, fields, seven_once_told, group=1)
    [trajectory] = batch.trajectories
    assert batch.failed == 0
    assert trajectory.episode.rewards == (0.0, 1.0)
    assert trajectory.episode.info["invalid_action"] == NOT_AN_INT


def test_the_manifest_fields_default_to_no_penalty_and_no_parser() -> None:
    spec = LLMEnvSpec(env_type="rollout", entrypoint="typed_envs:IntGuessEnvironment")
    assert (spec.invalid_action_reward, spec.action_parser) == (0.0, None)
    for bad in ({"action_parser": "parse_guess"}, {"invalid_action_reward": float("nan")}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            LLMEnvSpec(env_type="rollout", entrypoint="typed_envs:IntGuessEnvironment", **bad)


def test_grpo_on_the_typed_env_fails_no_episode(tiny_model_dir: Path, tmp_path: Path) -> None:
    from agile_llmenvs.specs import RunManifest
    from agile_llmenvs.training import train_grpo

    manifest = RunManifest.model_validate(
        {
            "name": "typed-guess",
            "env": {
                "env_type": "rollout",
                "entrypoint": "typed_envs:IntGuessEnvironment",
                "action_field": "guess",
                "invalid_action_reward": -0.5,
            },
            "model": {"path": str(tiny_model_dir)},
            "training": {
                "algorithm": "grpo",
                "max_steps": 2,
                "batch_size": 2,
                "group_size": 2,
                "max_new_tokens": 4,
                "output_dir": str(tmp_path / "run"),
            },
            "seed": 0,
        }
    )
    result = train_grpo(manifest)
    with open(result.output_dir / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [float(row["step"]) for row in rows] == [1.0, 2.0]
    assert [float(row["failed_episodes"]) for row in rows] == [0.0, 0.0]
    # the random policy's text is no int: every turn of the three is invalid
    assert [float(row["reward_mean"]) for row in rows] == [-1.5, -1.5]


def test_a_client_built_by_hand_with_its_action_field_refuses_as_an_invalid_turn(
    tokenizer: Any,
) -> None:
    """``InProcessEnvClient(env, action_field="guess")`` in a ``RolloutHarness`` whose own
    settings name no field: the text goes in the client's field, so its refusal is the
    policy's (the episode used to end with ENV_ERROR, where a served env's went on)."""
    from agile_llmenvs.llm_envs import RolloutHarness
    from agile_llmenvs.transport.client import InProcessEnvClient

    client = InProcessEnvClient(typed_envs.IntGuessEnvironment(), action_field="guess")
    harness = RolloutHarness(client, tokenizer, 3)
    harness.reset(seed=0)
    turn = harness.step([*tokenizer.encode("seven, I think", add_special_tokens=False), EOS])
    assert not turn.done
    assert turn.info["invalid_action"] == NOT_AN_INT
    turn = harness.step([*tokenizer.encode("7", add_special_tokens=False), EOS])
    assert turn.done
    assert harness.get_episode_data().stop_reason is StopReason.TERMINATED
