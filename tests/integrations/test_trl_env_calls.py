"""The env calls of a TRL rollout: one round's run together, each bounded by ``io_timeout_s``."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

from integrations import trl_fakes
from integrations.trl_fakes import scripted
from transformers import AutoTokenizer

from agile_llmenvs.integrations.trl import TRLEnv, TRLEnvConfig
from agile_llmenvs.specs import LLMEnvSpec


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _spec(entrypoint: str, max_turns: int = 1, **env_config: Any) -> LLMEnvSpec:
    return LLMEnvSpec.model_validate(
        {
            "env_type": "rollout",
            "entrypoint": entrypoint,
            "max_turns": max_turns,
            "env_config": env_config,
        }
    )


def test_the_env_calls_of_a_round_run_together(tokenizer: Any) -> None:
    delay = 0.25
    spec = _spec("integrations.trl_fakes:TimedEnv", max_turns=2, rows=2, turns=2, delay_s=delay)
    with TRLEnv(spec, tokenizer) as env:
        env.build(max_tokens_per_turn=8, max_model_len=None)
        trl_fakes.CALLS.clear()
        start = time.monotonic()
        columns = env.rollout([env.prompts[1]] * 4, scripted(tokenizer, "1"), num_generations=4)
        elapsed = time.monotonic() - start
    assert columns["env_reward"] == [2.0] * 4
    rounds: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for call, turn, began, ended in trl_fakes.CALLS:
        rounds[call, turn].append((began, ended))
    # three rounds (the resets, then two turns) of four calls each
    assert sorted(rounds) == [("reset", 0), ("step", 1), ("step", 2)]
    for calls in rounds.values():
        assert len(calls) == 4
        # every call of the round was running at once: the last began before the first ended
        assert max(began for began, _ in calls) < min(ended for _, ended in calls)
    # one after another they would take 12 delays; together about 3 (and generation)
    assert elapsed < 6 * delay, elapsed


def test_an_env_call_past_io_timeout_fails_only_its_episode(tokenizer: Any) -> None:
    # RowEnv blocks for hang_s on the action "hang"; the first context of the first turn says it
    spec = _spec("echo_envs:RowEnv", rows=2, hang_s=5.0)
    config = TRLEnvConfig(io_timeout_s=0.5)
    with TRLEnv(spec, tokenizer, config=config) as env:
        env.build(max_tokens_per_turn=8, max_model_len=None)
        start = time.monotonic()
        columns = env.rollout(
            [env.prompts[1]] * 4, scripted(tokenizer, "hang|1", "1"), num_generations=4
        )
        elapsed = time.monotonic() - start
        report = env.report
        assert report is not None
        # the hung episode failed; the next wave refilled its row
        assert [p.failed for p in report.episodes] == [True, False, False, False, False]
        assert [p.rows for p in report.episodes] == [(), (0,), (1,), (2,), (3,)]
        error = report.episodes[0].episode.info["error"]
        assert error == "the env call exceeded io_timeout_s=0.5"
        assert columns["env_reward"] == [1.0] * 4
        assert elapsed < 3.0, elapsed  # the rollout did not wait for the hung call
        # the hung env was replaced: its slot plays the next rollout
        env.rollout([env.prompts[0]] * 4, scripted(tokenizer, "0"), num_generations=4)
        assert env.report is not None
        assert [p.failed for p in env.report.episodes] == [False] * 4
    assert env.stats.failed_episodes == 1


def test_io_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="io_timeout_s must be positive, got 0"):
        TRLEnvConfig(io_timeout_s=0)
