"""SFT and DPO steps over micro-batches equal the whole-batch step (plain SGD, exact)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from training.update_cases import load_model, make_learner

from agile_llmenvs.llm_envs.dataset_env import PreferenceBatch, SFTBatch
from agile_llmenvs.training.policy import micro_batch_slices
from agile_llmenvs.training.supervised import DPOObjective, SFTObjective


def _rows(seed: int, lengths: list[int], prompt: int) -> tuple[torch.Tensor, ...]:
    """Right-padded ids, attention and labels (-100 on the prompt and the padding)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(4, 300, (len(lengths), width), generator=generator)
    attention = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    ids = ids * attention
    labels = ids.masked_fill(attention == 0, -100)
    labels[:, :prompt] = -100
    return ids, attention, labels


def _sft_batch() -> SFTBatch:
    ids, attention, labels = _rows(0, [7, 12, 5, 10, 9], prompt=3)
    return SFTBatch(ids, attention, labels, torch.full((5,), 3))


def _dpo_batch() -> PreferenceBatch:
    chosen = _rows(1, [8, 11, 6, 9, 12], prompt=3)
    rejected = _rows(2, [10, 7, 9, 12, 6], prompt=3)
    rejected[0][:, :3] = chosen[0][:, :3]  # one prompt per pair
    return PreferenceBatch(
        chosen[0], chosen[1], rejected[0], rejected[1], torch.full((5,), 3), chosen[2], rejected[2]
    )


def _update(model_dir: Path, objective_of: Any, batch: Any, micro: int | None) -> torch.Tensor:
    model = load_model(model_dir)
    objective = objective_of(load_model(model_dir).eval())
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    learner = make_learner(model, Accelerator(cpu=True))
    total = objective.units(batch)
    learner.step(
        micro_batch_slices(objective.rows(batch), micro),
        lambda rows: objective.loss(learner.model, batch, rows, total)[0],
    )
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before


def _relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_sft_micro_batches_give_the_whole_batch_update(tiny_model_dir: Path) -> None:
    batch = _sft_batch()
    whole = _update(tiny_model_dir, lambda ref: SFTObjective(chunk_tokens=5), batch, None)
    assert whole.abs().max() > 1e-4
    for micro in (1, 3):
        delta = _update(tiny_model_dir, lambda ref: SFTObjective(chunk_tokens=5), batch, micro)
        assert _relative_difference(delta, whole) < 1e-5, micro


def test_sft_loss_is_the_mean_over_every_response_token(tiny_model_dir: Path) -> None:
    batch = _sft_batch()
    model = load_model(tiny_model_dir)
    objective = SFTObjective(chunk_tokens=4)
    total = objective.units(batch)
    assert total == 4 + 9 + 2 + 7 + 6  # response tokens: each row's length - 3 prompt tokens
    with torch.no_grad():
        loss = sum(
            objective.loss(model, batch, rows, total)[0] for rows in micro_batch_slices(5, 2)
        )
        # the model's own loss over full logits: a mean over labelled tokens
        reference = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels
        ).loss
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=0.0)


def test_dpo_micro_batches_give_the_whole_batch_update(tiny_model_dir: Path) -> None:
    batch = _dpo_batch()

    def objective(reference: Any) -> DPOObjective:
        return DPOObjective(reference, beta=0.5, chunk_tokens=7)

    whole = _update(tiny_model_dir, objective, batch, None)
    assert whole.abs().max() > 1e-6
    for micro in (1, 3):
        delta = _update(tiny_model_dir, objective, batch, micro)
        assert _relative_difference(delta, whole) < 1e-5, micro
