"""GRPO: the training batch layout, a short run that learns, and resuming."""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from agile_llmenvs.core import (
    EpisodeData,
    RolloutBatch,
    StopReason,
    TokenSample,
    Trajectory,
    failed_episode,
)
from agile_llmenvs.llm_envs.tasks import Task
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
    assert result.checkpoint_dir == result.output_dir / "checkpoint-250"
    assert (result.checkpoint_dir / "model" / "config.json").exists()
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
        torch.load(d / "checkpoint-4" / "rank0.pt", weights_only=True)["collector"]
        for d in (tmp_path / "a", Path(resumed_dir))
    ]
    assert saved[0] == saved[1]


def test_resume_without_a_checkpoint_says_so(make_manifest: Callable[..., RunManifest]) -> None:
    with pytest.raises(CheckpointError, match="no complete checkpoint to resume from"):
        train_grpo(make_manifest("quickstart.yaml", max_steps=1), resume=True)


def test_build_policy_batch_leaves_out_members_not_kept() -> None:
    rollout = RolloutBatch(
        (
            _trajectory(0, (5, 6, 7), (False, True), (-0.5,)),
            _trajectory(1, (5, 6, 8), (False, True), (-0.25,)),
        ),
        group_size=2,
        informative_groups=1,
    )
    batch = build_policy_batch(rollout, torch.tensor([1.0, -1.0]), pad_id=0, kept=[False, True])
    assert batch.input_ids_BT.tolist() == [[5, 6, 8]]
    assert batch.advantages_B.tolist() == [-1.0]


def test_build_policy_batch_marks_missing_logps_and_refuses_misaligned_ones() -> None:
    missing = RolloutBatch(
        (_trajectory(0, (5, 6, 7, 8), (False, True, True), ()),), group_size=1, informative_groups=0
    )
    batch = build_policy_batch(missing, torch.tensor([1.0]), pad_id=0)
    assert batch.sampling_logps_BT[0, 0].item() == 0.0  # off the mask
    assert batch.sampling_logps_BT[0, 1:].isnan().all()  # scored by the trainer
    short = RolloutBatch(
        (_trajectory(0, (5, 6, 7, 8), (False, True, True), (-1.0,)),),
        group_size=1,
        informative_groups=0,
    )
    with pytest.raises(ValueError, match="1 sampling log-probs for 2 sampled tokens"):
        build_policy_batch(short, torch.tensor([1.0]), pad_id=0)


def test_passes_and_mini_batches_engage_the_clip_and_follow_the_schedule(
    make_manifest: Callable[..., RunManifest], dense_env: dict[str, Any]
) -> None:
    settings = {
        "env": dense_env,
        "batch_size": 4,
        "group_size": 4,
        "max_new_tokens": 4,
        "learning_rate": 0.01,
        "num_iterations": 2,
        "mini_batches": 2,
        "micro_batch_size": 3,
        "lr_scheduler": "linear",
        "warmup_steps": 1,
        "clip_eps": 0.05,
    }
    result = train_grpo(make_manifest("quickstart.yaml", max_steps=2, **settings))
    first, second = result.metrics
    # 2 steps x 2 passes x 2 mini-batches = 8 optimizer steps; the rate logged is the one
    # of each step's first optimizer step: 0 (warmup: 1/1), then 4: 1 - (4 - 1) / (8 - 1)
    assert first["learning_rate"] == pytest.approx(0.01)
    assert second["learning_rate"] == pytest.approx(0.01 * (1 - 3 / 7))
    # after the first optimizer step the ratio leaves 1 and the clip removes gradients
    assert first["clip_fraction"] > 0.0
    assert first["ratio_max"] > 1.05
    assert first["failed_episodes"] == 0.0
    assert first["dropped_groups"] == 0.0


def test_non_finite_rewards_fail_their_episodes_and_the_run_goes_on(
    make_manifest: Callable[..., RunManifest],
) -> None:
    env = {
        "env_type": "rollout",
        "entrypoint": "echo_envs:NonFiniteRewardEnv",
        "dataset_path": None,
        "rubric_file_path": None,
        "rubric_name": None,
    }
    settings = {"batch_size": 2, "group_size": 3, "max_new_tokens": 3}
    result = train_grpo(make_manifest("quickstart.yaml", max_steps=3, env=env, **settings))
    assert [row["step"] for row in result.metrics] == [1.0, 2.0, 3.0]
    assert sum(row["failed_episodes"] for row in result.metrics) > 0
    for row in result.metrics:
        assert math.isfinite(row["reward_mean"]), row
        assert math.isfinite(row["loss"]), row
