"""SFT and DPO on the shipped digits data: each moves its own objective the right way."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from agile_llmenvs.specs import RunManifest
from agile_llmenvs.training import train_dpo, train_sft
from agile_llmenvs.training.supervised import DPO_METRICS, SFT_METRICS


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_sft_lowers_the_loss(make_manifest: Callable[..., RunManifest]) -> None:
    result = train_sft(make_manifest("sft_digits.yaml", max_steps=30, learning_rate=3e-3))
    losses = [row["loss"] for row in result.metrics]
    assert _mean(losses[-5:]) < 0.7 * _mean(losses[:5]), losses
    assert list(result.metrics[0]) == list(SFT_METRICS)
    assert result.metrics_path is not None
    assert result.metrics_path.exists()


def test_dpo_raises_the_chosen_rejected_margin(make_manifest: Callable[..., RunManifest]) -> None:
    result = train_dpo(make_manifest("dpo_digits.yaml", max_steps=20, learning_rate=1e-3))
    margins = [row["margin"] for row in result.metrics]
    assert margins[0] == pytest.approx(0.0, abs=1e-4)  # the policy starts as its reference
    assert _mean(margins[-5:]) > 1.0, margins
    assert result.metrics[-1]["loss"] < result.metrics[0]["loss"]
    assert set(result.metrics[0]) == set(DPO_METRICS)


def test_sft_resume_appends_to_the_metrics(make_manifest: Callable[..., RunManifest]) -> None:
    train_sft(make_manifest("sft_digits.yaml", max_steps=2))
    resumed = train_sft(make_manifest("sft_digits.yaml", max_steps=4), resume=True)
    assert [row["step"] for row in resumed.metrics] == [3.0, 4.0]
    assert resumed.metrics_path is not None
    lines = resumed.metrics_path.read_text().splitlines()
    assert [line.split(",")[0] for line in lines] == ["step", "1", "2", "3", "4"]
