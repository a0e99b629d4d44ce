"""The rollout log: its exact records, the GRPO trainer writing them, and resuming."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agile_llmenvs._run_files import ROLLOUTS_FILE
from agile_llmenvs.core import (
    EpisodeData,
    RolloutBatch,
    StopReason,
    TokenSample,
    Trajectory,
    failed_episode,
)
from agile_llmenvs.llm_envs.collector import RolloutCollector
from agile_llmenvs.llm_envs.tasks import Task
from agile_llmenvs.specs import RunManifest, TrainingSpec
from agile_llmenvs.training import train_grpo
from agile_llmenvs.training.run import RolloutLog, episode_record, provenance

RECORD_KEYS = [
    "step",
    "group",
    "slot",
    "task",
    "reward",
    "rewards",
    "stop_reason",
    "failed",
    "samples",
]
SAMPLE_KEYS = ["token_ids", "provenance", "turn_ids", "spans"]


class _Letters:
    """Decodes id ``i`` as the ``i``-th lowercase letter (ids 0-25)."""

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def _two_turns() -> TokenSample:
    # prompt a b | sampled c d (turn 0) | env e f | sampled g (turn 1) | env h
    return TokenSample(
        token_ids=(0, 1, 2, 3, 4, 5, 6, 7),
        action_mask=(False, True, True, False, False, True, False),
        turn_ids=(-1, 0, 0, -1, -1, 1, -1),
        sampling_logps=(-0.1, -0.2, -0.3),
    )


def test_provenance_marks_prompt_sampled_and_env_per_id() -> None:
    assert provenance(_two_turns()) == "ppsseese"
    no_sampled = TokenSample((0, 1, 2), (False, False), (-1, -1))  # over the prompt limit
    assert provenance(no_sampled) == "ppp"


def test_episode_record_pins_every_field() -> None:
    episode = EpisodeData((_two_turns(),), (0.25, 0.5), StopReason.MAX_TURNS, {"x": 1})
    record = episode_record(7, Trajectory(2, 5, Task(seed=9, row_index=4), episode), _Letters())
    assert record == {
        "step": 7,
        "group": 2,
        "slot": 5,
        "task": {"seed": 9, "row_index": 4},
        "reward": 0.75,
        "rewards": [0.25, 0.5],
        "stop_reason": "max_turns",
        "failed": False,
        "samples": [
            {
                "token_ids": [0, 1, 2, 3, 4, 5, 6, 7],
                "provenance": "ppsseese",
                "turn_ids": [-1, -1, 0, 0, -1, -1, 1, -1],
                "spans": [
                    {"source": "prompt", "turn": -1, "text": "ab"},
                    {"source": "sampled", "turn": 0, "text": "cd"},
                    {"source": "env", "turn": -1, "text": "ef"},
                    {"source": "sampled", "turn": 1, "text": "g"},
                    {"source": "env", "turn": -1, "text": "h"},
                ],
            }
        ],
    }
    failed = episode_record(7, Trajectory(0, 0, Task(seed=1), failed_episode("boom")), _Letters())
    assert failed["samples"] == []
    assert failed["error"] == "boom"
    assert failed["stop_reason"] == "env_error"
    assert failed["failed"] is True


def test_log_writes_compact_lines_on_due_steps_only(tmp_path: Path) -> None:
    path = tmp_path / ROLLOUTS_FILE
    path.write_text('{"step": 1}\n', encoding="utf-8")  # a previous run's
    log = RolloutLog(path, _Letters(), every=2, count=1)
    assert not path.exists()
    episode = EpisodeData((_two_turns(),), (1.0,), StopReason.TERMINATED)
    trajectories = [Trajectory(0, slot, Task(seed=0), episode) for slot in range(3)]
    for step in (1, 2, 3, 4):
        log.maybe_write(step, trajectories)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4]
    assert all(", " not in line and ": " not in line for line in lines)

    RolloutLog(path, _Letters(), every=2, count=1, resume_step=3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [2]
    silent = RolloutLog(tmp_path / "none.jsonl", _Letters(), every=0, count=4)
    silent.maybe_write(10, trajectories)
    assert not silent.path.exists()


def test_failed_episodes_are_logged_at_every_step(tmp_path: Path) -> None:
    log = RolloutLog(tmp_path / ROLLOUTS_FILE, _Letters(), every=2, count=1)
    episode = EpisodeData((_two_turns(),), (1.0,), StopReason.TERMINATED)
    trajectories = [
        Trajectory(0, 0, Task(seed=0), failed_episode("first")),
        Trajectory(0, 1, Task(seed=0), episode),
        Trajectory(0, 2, Task(seed=0), failed_episode("third")),
    ]
    for step in (1, 2):
        log.maybe_write(step, trajectories)
    records = [json.loads(line) for line in log.path.read_text().splitlines()]
    # step 1 is not due: its failed episodes only; step 2 is: its first one, then the
    # failed ones among the rest, in batch order
    assert [(r["step"], r["slot"], r.get("error")) for r in records] == [
        (1, 0, "first"),
        (1, 2, "third"),
        (2, 0, "first"),
        (2, 2, "third"),
    ]
    silent = RolloutLog(tmp_path / "none.jsonl", _Letters(), every=0, count=4)
    silent.maybe_write(3, trajectories[1:2])  # nothing failed, nothing due: no file
    assert not silent.path.exists()
    silent.maybe_write(4, trajectories[2:])
    assert [json.loads(line)["slot"] for line in silent.path.read_text().splitlines()] == [2]


def test_training_spec_defaults_and_bounds() -> None:
    spec = TrainingSpec(algorithm="grpo")
    assert (spec.log_rollouts_every, spec.log_rollouts_count) == (10, 4)
    assert TrainingSpec(algorithm="grpo", log_rollouts_every=0).log_rollouts_every == 0
    with pytest.raises(ValidationError, match="log_rollouts_every"):
        TrainingSpec(algorithm="grpo", log_rollouts_every=-1)
    with pytest.raises(ValidationError, match="log_rollouts_count"):
        TrainingSpec(algorithm="grpo", log_rollouts_count=0)


def _recording_collect(monkeypatch: pytest.MonkeyPatch) -> list[RolloutBatch]:
    """Record every batch the collector hands the trainer, in step order."""
    batches: list[RolloutBatch] = []
    collect = RolloutCollector.collect

    def recording(self: RolloutCollector, *args: Any, **kwargs: Any) -> RolloutBatch:
        batch = collect(self, *args, **kwargs)
        batches.append(batch)
        return batch

    monkeypatch.setattr(RolloutCollector, "collect", recording)
    return batches


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_grpo_logs_the_trajectories_it_trained_on(
    make_manifest: Callable[..., RunManifest],
    dense_env: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batches = _recording_collect(monkeypatch)
    manifest = make_manifest(
        "quickstart.yaml",
        env=dense_env,
        max_steps=4,
        batch_size=2,
        group_size=2,
        max_new_tokens=3,
        log_rollouts_every=2,
        log_rollouts_count=3,
    )
    result = train_grpo(manifest)
    records = _lines(result.output_dir / ROLLOUTS_FILE)
    assert [r["step"] for r in records] == [2, 2, 2, 4, 4, 4]
    for record in records:
        assert list(record) == RECORD_KEYS
        trajectory = batches[record["step"] - 1].trajectories[records.index(record) % 3]
        assert (record["group"], record["slot"]) == (trajectory.group, trajectory.slot)
        assert record["rewards"] == list(trajectory.episode.rewards)
        assert record["reward"] == trajectory.reward
        assert record["stop_reason"] == str(trajectory.episode.stop_reason)
        [sample] = trajectory.episode.samples
        [logged] = record["samples"]
        assert list(logged) == SAMPLE_KEYS
        assert logged["token_ids"] == list(sample.token_ids)
        sampled = [source == "s" for source in logged["provenance"][1:]]
        assert sampled == list(sample.action_mask)
        assert set(logged["provenance"]) <= {"p", "s"}  # one turn: no env ids after it
        assert logged["turn_ids"] == [-1, *sample.turn_ids]
        assert [span["source"] for span in logged["spans"]] == ["prompt", "sampled"]


def test_resumed_runs_append_and_drop_what_came_after_the_checkpoint(
    make_manifest: Callable[..., RunManifest], dense_env: dict[str, Any]
) -> None:
    settings = {"env": dense_env, "batch_size": 2, "group_size": 2, "max_new_tokens": 3}
    settings |= {"log_rollouts_every": 1, "log_rollouts_count": 1}
    first = train_grpo(make_manifest("quickstart.yaml", max_steps=2, **settings))
    path = first.output_dir / ROLLOUTS_FILE
    straight = _lines(path)
    with path.open("a", encoding="utf-8") as file:  # a step run after the checkpoint, then killed
        file.write(json.dumps({**straight[-1], "step": 3}) + "\n" + '{"step": 4, "gro')
    train_grpo(make_manifest("quickstart.yaml", max_steps=3, **settings), resume=True)
    records = _lines(path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[:2] == straight
