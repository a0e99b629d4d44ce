"""GRPO: the training batch layout, a short run that learns, and resuming."""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from agile_llmenvs.llm_envs.episode import EpisodeData, StopReason, TokenSample
from agile_llmenvs.llm_envs.tasks import Task
from agile_llmenvs.llm_envs.trajectory import RolloutBatch, Trajectory, failed_episode
from agile_llmenvs.specs import RunManifest
from agile_llmenvs.training import CheckpointError, train_grpo
from agile_llmenvs.training.grpo import GRPO_METRICS, build_policy_batch


def _trajectory(slot: int, ids: tuple[int, ...], mask: tuple[bool, ...], logps: tuple[float, ...]):
    sample = TokenSample(ids, mask, tuple(0 if m else -1 for m in mask), logps)
    episode = EpisodeData((sample,), (1.0,), StopReason.TERMINATED)
    return Trajectory(0, slot, Task(seed=0, row_index=0), episode)


def test_build_policy_batch_pins_layout() -> None:
    rollout = RolloutBatch(
        (
            _trajectory(0, (5, 6, 7, 8), (False, True, True), (-0.5, -0.25)),
            _trajectory(1, (5, 6, 9), (False, True), (-1.0,)),
            Trajectory(0, 2, Task(seed=0, row_index=0), failed_episode("boom")),
        ),
        group_size=3,
        informative_groups=1,
    )
    batch = build_policy_batch(rollout, torch.tensor([1.0, -2.0, 0.5]), pad_id=0)
    assert batch.input_ids_BT.tolist() == [[5, 6, 7, 8], [5, 6, 9, 0]]
    assert batch.attention_mask_BT.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert batch.action_mask_BT.tolist() == [[False, True, True], [False, True, False]]
    assert batch.sampling_logps_BT.tolist() == [[0.0, -0.5, -0.25], [0.0, -1.0, 0.0]]
    assert batch.advantages_B.tolist() == [1.0, -2.0]  # the failed episode has no rows


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


@pytest.mark.slow
def test_grpo_raises_reward_on_the_tiny_model(make_manifest: Callable[..., RunManifest]) -> None:
    # the quick start's settings, cut short: ~25 s on 2 cores
    result = train_grpo(make_manifest("quickstart.yaml", max_steps=250))
    rewards = [row["reward_mean"] for row in result.metrics]
    first, last = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
    assert first < 0.05, rewards[:20]
    assert last > first + 0.15, rewards[-20:]
    rows = _rows(result.output_dir / "metrics.csv")
    assert list(rows[0]) == list(GRPO_METRICS)
    assert [int(row["step"]) for row in rows] == list(range(1, 251))
    assert all(math.isfinite(float(row["loss"])) for row in rows)
    assert (result.output_dir / "checkpoint" / "model" / "config.json").exists()
    assert (result.output_dir / "metrics.png").exists()


def test_resume_continues_the_task_sequence_and_the_metrics(
    make_manifest: Callable[..., RunManifest], dense_env: dict[str, Any], tmp_path: Path
) -> None:
    settings = {"env": dense_env, "batch_size": 2, "group_size": 2, "max_new_tokens": 3}
    straight = train_grpo(
        make_manifest("quickstart.yaml", max_steps=4, output_dir=str(tmp_path / "a"), **settings)
    )
    resumed_dir = str(tmp_path / "b")
    first = make_manifest("quickstart.yaml", max_steps=2, output_dir=resumed_dir, **settings)
    train_grpo(first)
    second = make_manifest("quickstart.yaml", max_steps=4, output_dir=resumed_dir, **settings)
    resumed = train_grpo(second, resume=True)

    assert [row["step"] for row in resumed.metrics] == [3.0, 4.0]
    rows = _rows(Path(resumed_dir) / "metrics.csv")
    assert [int(row["step"]) for row in rows] == [1, 2, 3, 4]
    for key in ("reward_mean", "loss", "grad_norm"):  # same tasks, samples and weights
        assert [r[key] for r in resumed.metrics] == pytest.approx(
            [r[key] for r in straight.metrics[2:]], rel=1e-4, abs=1e-6
        )
    saved = [
        torch.load(d / "checkpoint" / "rng_rank0.pt", weights_only=False)["collector"]
        for d in (tmp_path / "a", Path(resumed_dir))
    ]
    assert saved[0] == saved[1]


def test_resume_without_a_checkpoint_says_so(make_manifest: Callable[..., RunManifest]) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        train_grpo(make_manifest("quickstart.yaml", max_steps=1), resume=True)
