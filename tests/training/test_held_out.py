"""Evaluation during training: greedy, on held-out tasks, logged, changing nothing else."""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from agile_llmenvs.errors import EnvBuildError
from agile_llmenvs.specs import RunManifest
from agile_llmenvs.training import train_grpo

TRAINING_KEYS = ("reward_mean", "reward_std", "loss", "grad_norm", "kl", "ratio_mean")


def _run(
    make_manifest: Callable[..., RunManifest], env: dict[str, Any], out: Path, **kw: Any
) -> Any:
    return train_grpo(
        make_manifest(
            "quickstart.yaml",
            env={**env, "train_test_split": 0.3},
            batch_size=2,
            group_size=2,
            max_new_tokens=3,
            max_steps=4,
            output_dir=str(out),
            **kw,
        )
    )


def test_eval_rows_are_logged_and_training_is_unchanged(
    make_manifest: Callable[..., RunManifest], dense_env: dict[str, Any], tmp_path: Path
) -> None:
    plain = _run(make_manifest, dense_env, tmp_path / "plain")
    evaluated = _run(make_manifest, dense_env, tmp_path / "eval", eval_every=2, eval_tasks=3)
    for key in TRAINING_KEYS:  # the same tasks, samples and updates, to the bit
        assert [r[key] for r in evaluated.metrics] == [r[key] for r in plain.metrics], key
    assert all(math.isnan(r["eval_reward_mean"]) for r in plain.metrics)
    rewards = [r["eval_reward_mean"] for r in evaluated.metrics]
    assert math.isnan(rewards[0])
    assert math.isnan(rewards[2])
    assert 0.0 <= rewards[1] <= 1.0
    assert 0.0 <= rewards[3] <= 1.0
    with (tmp_path / "eval" / "metrics.csv").open(newline="") as file:
        cells = [
            (row["eval_reward_mean"], row["eval_success_rate"]) for row in csv.DictReader(file)
        ]
    assert cells[0] == ("", "")
    assert cells[1][0] != ""
    states = [
        torch.load(run.checkpoint_dir / "rank0.pt", weights_only=True)["collector"]
        for run in (plain, evaluated)
    ]
    assert states[0] == states[1]  # the training task sequence did not move


def test_eval_of_a_dataset_env_without_a_test_split_says_what_to_set(
    make_manifest: Callable[..., RunManifest], dense_env: dict[str, Any]
) -> None:
    manifest = make_manifest("quickstart.yaml", env=dense_env, max_steps=1, eval_every=1)
    with pytest.raises(EnvBuildError, match="has no test rows: set `train_test_split`"):
        train_grpo(manifest)
