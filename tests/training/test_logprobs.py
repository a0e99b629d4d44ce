"""Scored-token log-probs equal a full log-softmax's, values and gradients, in any chunking."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from training.update_cases import load_model

from agile_llmenvs.backends.types import TokenDistribution
from agile_llmenvs.training.objective import scored_token_logps


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
        distribution=TokenDistribution(temperature=temperature),
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


def _shaped_by_hand(
    logits_BTV: torch.Tensor, ids: torch.Tensor, distribution: TokenDistribution
) -> torch.Tensor:
    """Log-probs of the next ids under ``distribution``, spelled out position by position:
    the penalty over the row's ids up to the position, the temperature, then min-p, top-k
    and top-p (each over what the one before kept), the next id always kept."""
    rows, positions, _ = logits_BTV.shape
    out = torch.zeros(rows, positions, dtype=logits_BTV.dtype)
    for b in range(rows):
        for t in range(positions):
            logits_V = logits_BTV[b, t]
            factor_V = torch.ones_like(logits_V)
            for seen in set(ids[b, : t + 1].tolist()):
                # a positive logit divided by the penalty, another multiplied
                penalty = distribution.repetition_penalty
                factor_V[seen] = 1 / penalty if logits_V[seen] > 0 else penalty
            scaled_V = logits_V * factor_V / distribution.temperature
            probs_V = torch.softmax(scaled_V.detach().double(), dim=-1)
            kept = set(range(len(probs_V)))
            if distribution.truncated and distribution.min_p:
                kept = {i for i in kept if probs_V[i] >= distribution.min_p * probs_V.max()}
            order = sorted(kept, key=lambda i: -float(probs_V[i]))
            if distribution.truncated and distribution.top_k:
                order = order[: distribution.top_k]
            if distribution.truncated and distribution.top_p < 1.0:
                total, mass, nucleus = float(probs_V[order].sum()), 0.0, []
                for i in order:  # the likeliest, up to the one reaching top_p of what is left
                    nucleus.append(i)
                    mass += float(probs_V[i]) / total
                    if mass >= distribution.top_p:
                        break
                order = nucleus
            target = int(ids[b, t + 1])
            kept_V = torch.zeros_like(scaled_V, dtype=torch.bool)
            kept_V[[*order, target]] = True
            shaped_V = scaled_V.masked_fill(~kept_V, -float("inf"))
            out[b, t] = torch.log_softmax(shaped_V, dim=-1)[target]
    return out


SHAPED = [
    TokenDistribution(temperature=0.7, top_p=0.8, top_k=20),
    TokenDistribution(temperature=0.7, repetition_penalty=1.1),
    TokenDistribution(temperature=1.0, min_p=0.6, top_p=0.5, repetition_penalty=1.3),
    TokenDistribution(temperature=0.7, top_p=0.8, top_k=20, truncated=False),
]


@pytest.mark.parametrize("distribution", SHAPED, ids=["top-p-k", "penalty", "all", "untruncated"])
def test_shaped_distributions_match_a_masked_log_softmax(
    tiny_model_dir: Path, distribution: TokenDistribution
) -> None:
    ids, attention, mask = _inputs()
    model = load_model(tiny_model_dir)
    with torch.no_grad():  # sharpened: the truncation then keeps few tokens
        model.lm_head.weight.mul_(3.0)
    out = scored_token_logps(
        model, ids, attention, mask, distribution=distribution, chunk_tokens=4, with_entropy=True
    )
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    (out.logps_BT * weights).sum().backward()
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    expected = _shaped_by_hand(logits, ids, distribution) * mask
    torch.testing.assert_close(out.logps_BT, expected.detach(), rtol=0, atol=1e-5)
    plain = torch.log_softmax(logits / distribution.temperature, dim=-1)
    plain = plain.gather(-1, ids[:, 1:, None])[..., 0] * mask
    shaped = distribution.truncates or distribution.penalizes
    assert ((out.logps_BT - plain).abs().max() > 0.05) == shaped  # the shaping shows
    (expected * weights).sum().backward()
    for mine, theirs in zip(ours, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


def test_truncated_entropy_is_over_the_kept_tokens(tiny_model_dir: Path) -> None:
    ids, attention, mask = _inputs()
    model = load_model(tiny_model_dir)
    one = TokenDistribution(top_k=1)  # one token kept (with the scored one, at most two)
    with torch.no_grad():
        out = scored_token_logps(model, ids, attention, mask, distribution=one, with_entropy=True)
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    assert out.entropy_BT is not None
    is_argmax = ids[:, 1:] == logits.argmax(dim=-1)
    # the argmax scored: a certain distribution, log-prob and entropy 0
    assert (out.logps_BT[mask & is_argmax] == 0).all()
    assert (out.entropy_BT[mask & is_argmax].abs() < 1e-6).all()
    # another id: it and the argmax share the mass, an entropy between 0 and log 2
    other = mask & ~is_argmax
    assert other.sum() > 10
    assert ((out.entropy_BT[other] > 0) & (out.entropy_BT[other] <= 0.6932)).all()


def test_bf16_output_layer_gradient_does_not_grow_with_the_chunks(tiny_model_dir: Path) -> None:
    # 4 rows of 180 ids: 716 scored positions, in one chunk or in 179 chunks of 4
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(4, 400, (4, 180), generator=generator)
    attention = torch.ones_like(ids)
    mask = torch.ones(4, 179, dtype=torch.bool)

    def output_layer_grad(model: torch.nn.Module, chunk_tokens: int, bf16: bool) -> torch.Tensor:
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            scored = scored_token_logps(model, ids, attention, mask, chunk_tokens=chunk_tokens)
        scored.logps_BT.sum().backward()
        return model.lm_head.weight.grad.double().clone()

    exact = output_layer_grad(load_model(tiny_model_dir).double(), 716, bf16=False)
    model = load_model(tiny_model_dir)
    errors = {
        chunks: float((output_layer_grad(model, 716 // chunks, True) - exact).norm() / exact.norm())
        for chunks in (1, 179)
    }
    print(f"relative error of the bf16 output-layer gradient: {errors}")
    assert errors[179] <= 2 * errors[1]
