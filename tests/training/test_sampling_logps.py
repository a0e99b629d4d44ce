"""The sampler's log-probs are the trainer's at the first pass; rows without them are scored."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from training.first_pass import SHAPED, first_pass, rollout_batch
from training.update_cases import load_model, make_learner

from agile_llmenvs.backends import HFBackend, SamplingParams, TokenDistribution
from agile_llmenvs.training.grpo import PolicyBatch, UpdateSettings, grpo_update


@pytest.mark.parametrize("params", SHAPED.values(), ids=SHAPED.keys())
def test_first_pass_ratio_is_one_under_every_sampling_setting(
    sharp_model_dir: Path, params: SamplingParams
) -> None:
    batch, metrics, trainer = first_pass(sharp_model_dir, params)
    mask = batch.action_mask_BT
    torch.testing.assert_close(trainer[mask], batch.sampling_logps_BT[mask], rtol=0, atol=1e-5)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["clip_fraction"] == 0.0


def test_truncated_logprobs_scored_untruncated_carry_the_kept_mass(
    sharp_model_dir: Path,
) -> None:
    # the ratio TRL and vLLM users see: the sampler's truncated log-probs over the whole
    # vocabulary's, exp(log p - log (p / kept mass)) = the kept mass, well below 1
    params = SHAPED["top-p-k"]
    model, batch = rollout_batch(sharp_model_dir, params)
    untruncated = TokenDistribution.of(dataclasses.replace(params, truncated_logprobs=False))
    learner = make_learner(model, Accelerator(cpu=True))
    metrics = grpo_update(learner, batch, UpdateSettings(distribution=untruncated))
    assert metrics["ratio_mean"] < 0.95


def test_a_checkpoints_repetition_penalty_is_not_sampled(
    sharp_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    shipped = tmp_path / "shipped"
    model = load_model(sharp_model_dir)
    model.generation_config.repetition_penalty = 1.1
    model.save_pretrained(shipped)
    AutoTokenizer.from_pretrained(sharp_model_dir).save_pretrained(shipped)
    backend = HFBackend(shipped)
    assert backend.model.generation_config.repetition_penalty == 1.1
    _, metrics, _ = first_pass(shipped, SHAPED["top-p-k"], backend)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)


def test_rows_without_sampler_logps_are_scored_by_the_policy(tiny_model_dir: Path) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1)
    model, batch = rollout_batch(tiny_model_dir, params)
    mask = batch.action_mask_BT
    missing = torch.where(mask, torch.full_like(batch.sampling_logps_BT, math.nan), 0.0)
    without = PolicyBatch(
        batch.input_ids_BT, batch.attention_mask_BT, mask, missing, batch.advantages_B
    )
    with_logps = grpo_update(make_learner(model, Accelerator(cpu=True)), batch, UpdateSettings())
    model_b = load_model(tiny_model_dir)
    scored = grpo_update(make_learner(model_b, Accelerator(cpu=True)), without, UpdateSettings())
    # on-policy either way: the same loss and update, and ratios of exactly 1
    assert scored["ratio_max"] == 1.0
    assert scored["loss"] == pytest.approx(with_logps["loss"], abs=1e-5)
    for a, b in zip(model.parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
