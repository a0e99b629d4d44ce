"""Scored-token log-probs equal a full log-softmax's, values and gradients, in any chunking."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from training.update_cases import load_model

from agile_llmenvs.training.logprobs import scored_token_logps


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 400, (3, 12), generator=generator)
    attention = torch.ones(3, 12, dtype=torch.long)
    attention[2, 9:] = 0
    mask = torch.rand(3, 11, generator=generator) > 0.4
    mask[2, 8:] = False
    return ids, attention, mask


def _full(
    model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor, t: float
) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    return torch.log_softmax(logits / t, dim=-1)


@pytest.mark.parametrize(("chunk_tokens", "temperature"), [(1, 1.0), (4, 0.5), (1000, 0.7)])
def test_values_entropy_and_gradients_match_a_full_log_softmax(
    tiny_model_dir: Path, chunk_tokens: int, temperature: float
) -> None:
    ids, attention, mask = _inputs()
    model = load_model(tiny_model_dir)
    out = scored_token_logps(
        model,
        ids,
        attention,
        mask,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
        with_entropy=True,
    )
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    (out.logps_BT * weights).sum().backward()
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    full = _full(model, ids, attention, temperature)
    expected = full.gather(-1, ids[:, 1:, None])[..., 0] * mask
    assert out.entropy_BT is not None
    torch.testing.assert_close(out.logps_BT, expected.detach(), rtol=0, atol=2e-6)
    entropy = -(full.exp() * full).sum(-1) * mask
    torch.testing.assert_close(out.entropy_BT, entropy.detach(), rtol=0, atol=2e-5)
    assert (out.logps_BT[~mask] == 0).all()
    (expected * weights).sum().backward()
    for mine, theirs in zip(ours, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)


def test_no_full_logits_are_requested_from_the_model(tiny_model_dir: Path) -> None:
    ids, attention, mask = _inputs()
    model = load_model(tiny_model_dir)
    scored_token_logps(model, ids, attention, mask)  # the first call probes the logits once
    shapes: list[torch.Size] = []
    model.lm_head.register_forward_hook(lambda m, i, o: shapes.append(o.shape))
    scored_token_logps(model, ids, attention, mask)
    assert shapes == [torch.Size([3, 1, model.config.vocab_size])]  # one position per row


def test_bf16_autocast_scores_close_to_fp32(tiny_model_dir: Path) -> None:
    ids, attention, mask = _inputs()
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        fp32 = scored_token_logps(model, ids, attention, mask).logps_BT
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = scored_token_logps(model, ids, attention, mask).logps_BT
    assert bf16.dtype == torch.float32
    assert 0 < (bf16 - fp32).abs().max() < 0.1  # bf16 matmuls: close, not equal


def test_bf16_autocast_backward_reaches_the_fp32_weights(tiny_model_dir: Path) -> None:
    ids, attention, mask = _inputs()
    model = load_model(tiny_model_dir)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logps = scored_token_logps(model, ids, attention, mask).logps_BT
    logps.sum().backward()
    grad = model.lm_head.weight.grad
    assert grad is not None
    assert grad.dtype == torch.float32
    assert torch.isfinite(grad).all()
    assert grad.abs().sum() > 0
