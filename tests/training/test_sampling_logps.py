"""The sampler's log-probs are the trainer's at the first pass; rows without them are scored."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from fakes import digit_messages
from training.update_cases import load_model, make_learner

from agile_llmenvs.backends import HFBackend, SamplingParams
from agile_llmenvs.training.grpo_update import UpdateSettings, grpo_update
from agile_llmenvs.training.logprobs import scored_token_logps
from agile_llmenvs.training.policy_batch import PolicyBatch


def _rollout_batch(model_dir: Path, params: SamplingParams) -> tuple[Any, PolicyBatch]:
    """Six digit prompts sampled by HFBackend on the tiny model, laid out right-padded."""
    from transformers import AutoTokenizer

    model = load_model(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        list(tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=False))
        for m in digit_messages(0, 1, 2, 3, 4, 5)
    ]
    generations = HFBackend.from_model(model, tokenizer).generate(prompts, params)
    rows = [(p, g.token_ids, g.logprobs) for p, g in zip(prompts, generations, strict=True)]
    width = max(len(p) + len(ids) for p, ids, _ in rows)
    ids_BT = torch.zeros(len(rows), width, dtype=torch.long)
    action_BT = torch.zeros(len(rows), width - 1, dtype=torch.bool)
    sampling_BT = torch.zeros(len(rows), width - 1)
    for b, (prompt, completion, logps) in enumerate(rows):
        ids_BT[b, : len(prompt) + len(completion)] = torch.tensor([*prompt, *completion])
        action_BT[b, len(prompt) - 1 : len(prompt) - 1 + len(completion)] = True
        sampling_BT[b, len(prompt) - 1 : len(prompt) - 1 + len(completion)] = torch.tensor(logps)
    attention_BT = (ids_BT != 0).long()
    attention_BT[:, 0] = 1
    for b, (prompt, completion, _) in enumerate(rows):
        attention_BT[b] = (torch.arange(width) < len(prompt) + len(completion)).long()
    advantages = torch.linspace(-1.0, 1.0, len(rows))
    return model, PolicyBatch(ids_BT, attention_BT, action_BT, sampling_BT, advantages)


def test_recorded_logps_at_temperature_half_equal_the_trainers(tiny_model_dir: Path) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.5, seed=3)
    model, batch = _rollout_batch(tiny_model_dir, params)
    assert batch.action_mask_BT.sum() > 20
    with torch.no_grad():
        trainer = scored_token_logps(
            model,
            batch.input_ids_BT,
            batch.attention_mask_BT,
            batch.action_mask_BT,
            temperature=0.5,
        ).logps_BT
    mask = batch.action_mask_BT
    torch.testing.assert_close(trainer[mask], batch.sampling_logps_BT[mask], rtol=0, atol=1e-5)
    # the update's own first-pass ratios: 1 within 1e-5 on every sampled token
    learner = make_learner(model, Accelerator(cpu=True))
    metrics = grpo_update(learner, batch, UpdateSettings(temperature=0.5))
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["clip_fraction"] == 0.0


def test_top_p_truncation_is_not_in_the_first_pass_ratio(tiny_model_dir: Path) -> None:
    # temperature 0.7, top_p 0.9: the recorded log-probs are of the untruncated distribution,
    # like the trainer's, so the first-pass ratio stays 1; the truncated distribution's
    # log-probs would be higher by -log(kept mass), a ratio of the kept mass (< 1)
    params = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=5)
    model, batch = _rollout_batch(tiny_model_dir, params)
    learner = make_learner(model, Accelerator(cpu=True))
    with torch.no_grad():
        logits_BTV = model(
            input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT
        ).logits[:, :-1]
    probs_NV = torch.softmax(logits_BTV[batch.action_mask_BT] / 0.7, dim=-1)
    sorted_NV = probs_NV.sort(dim=-1, descending=True).values
    # top-p keeps the likeliest tokens up to and including the one that reaches 0.9
    before_NV = sorted_NV.cumsum(dim=-1) - sorted_NV
    kept_mass_N = (sorted_NV * (before_NV < 0.9)).sum(dim=-1)
    metrics = grpo_update(learner, batch, UpdateSettings(temperature=0.7))
    print(f"first-pass mean ratio {metrics['ratio_mean']:.6f}; truncated {kept_mass_N.mean():.4f}")
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert 0.5 < float(kept_mass_N.mean()) < 1.0


def test_rows_without_sampler_logps_are_scored_by_the_policy(tiny_model_dir: Path) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1)
    model, batch = _rollout_batch(tiny_model_dir, params)
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
