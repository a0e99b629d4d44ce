"""The sampling distribution's tensor operations on small cases worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from agile_llmenvs.backends._shaping import context_mask, penalize_, shape_
from agile_llmenvs.backends.types import SamplingParams, TokenDistribution

PROBS = [0.5, 0.3, 0.15, 0.05]


def _kept(distribution: TokenDistribution, probs: list[float] = PROBS) -> list[int]:
    logits_1V = torch.tensor([[math.log(p) for p in probs]])
    _, shaped_1V = shape_(logits_1V, distribution)
    return torch.isfinite(shaped_1V[0]).nonzero()[:, 0].tolist()


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    logits_1V = torch.tensor([[4.0, 3.0, 3.0, 1.0, 0.0]])
    _, shaped_1V = shape_(logits_1V, TokenDistribution(top_k=2))
    assert torch.isfinite(shaped_1V[0]).tolist() == [True, True, True, False, False]


def test_top_p_keeps_the_likeliest_until_the_rest_is_within_one_minus_p() -> None:
    # ascending 0.05, 0.15, 0.3, 0.5: cumulative 0.05, 0.2, 0.5, 1.0; those <= 0.25 go
    assert _kept(TokenDistribution(top_p=0.75)) == [0, 1]
    # the likeliest always stays
    assert _kept(TokenDistribution(top_p=0.1)) == [0]


def test_top_p_counts_the_mass_top_k_left() -> None:
    # top-3 renormalised: 0.5/0.95, 0.3/0.95, 0.15/0.95; ascending cumulative 0.158, 0.474, 1
    assert _kept(TokenDistribution(top_k=3, top_p=0.75)) == [0, 1]
    # top-4 is everything: 0.05, 0.2 <= 0.25 go, as without top-k
    assert _kept(TokenDistribution(top_k=4, top_p=0.75)) == [0, 1]
    assert _kept(TokenDistribution(top_k=2, top_p=0.9)) == [0, 1]


def test_min_p_keeps_tokens_at_least_min_p_of_the_likeliest() -> None:
    assert _kept(TokenDistribution(min_p=0.35)) == [0, 1]  # floor 0.175
    assert _kept(TokenDistribution(min_p=0.25)) == [0, 1, 2]  # floor 0.125


def test_min_p_comes_before_top_p() -> None:
    # min_p 0.25 leaves 0.5, 0.3, 0.15 (sum 0.95); top-p 0.75 over them: as top-3 above
    assert _kept(TokenDistribution(min_p=0.25, top_p=0.75)) == [0, 1]


def test_the_temperature_divides_before_the_truncation() -> None:
    logits_1V = torch.tensor([[2.0, 1.0, 0.0]])
    scaled_1V, shaped_1V = shape_(logits_1V, TokenDistribution(temperature=0.5))
    assert scaled_1V is shaped_1V  # nothing truncates: no copy
    assert scaled_1V.tolist() == [[4.0, 2.0, 0.0]]


def test_a_kept_id_survives_the_truncation() -> None:
    logits_2V = torch.tensor([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0]])
    _, shaped_2V = shape_(logits_2V, TokenDistribution(top_k=1), keep_N=torch.tensor([2, 0]))
    assert torch.isfinite(shaped_2V).tolist() == [[True, False, True], [True, False, False]]
    assert shaped_2V[0, 2] == 1.0


def test_the_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits_1V = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    seen_1V = torch.tensor([[True, True, False, False]])
    scaling_1V = penalize_(logits_1V, seen_1V, 2.0)
    assert logits_1V.tolist() == [[1.0, -4.0, 1.0, -1.0]]
    assert scaling_1V.tolist() == [[0.5, 2.0, 1.0, 1.0]]


def test_the_context_mask_counts_each_rows_first_ids_only() -> None:
    ids_2L = torch.tensor([[5, 6, 7], [8, 9, 9]])
    mask_2V = context_mask(ids_2L, torch.tensor([2, 1]), 10)
    assert mask_2V.nonzero().tolist() == [[0, 5], [0, 6], [1, 8]]


def test_greedy_params_record_untruncated_temperature_one_logprobs() -> None:
    params = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, repetition_penalty=1.2)
    assert TokenDistribution.of(params) == TokenDistribution(
        repetition_penalty=1.2, truncated=False
    )
    sampled = SamplingParams(temperature=0.7, top_p=0.5, min_p=0.1, truncated_logprobs=False)
    distribution = TokenDistribution.of(sampled)
    assert (distribution.temperature, distribution.top_p, distribution.min_p) == (0.7, 0.5, 0.1)
    assert not distribution.truncates


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("min_p", 1.0, r"^min_p must be in \[0, 1\), got 1.0$"),
        ("repetition_penalty", 0.0, r"^repetition_penalty must be > 0, got 0.0$"),
    ],
)
def test_sampling_params_refuse_bad_shaping(field: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def _vllm_top_p(logits_NV: torch.Tensor, top_p: float) -> torch.Tensor:
    """The kept set as vLLM's sort path finds it: sort ascending, drop while the cumulative
    probability is at most 1 - p, keep the likeliest."""
    ascending, order = logits_NV.sort(dim=-1)
    dropped = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
    dropped[:, -1] = False
    kept = torch.zeros_like(logits_NV, dtype=torch.bool)
    return kept.scatter_(-1, order, ~dropped)


@pytest.mark.parametrize("scale", [0.1, 8.0], ids=["flat-whole-sort", "peaked-candidates"])
def test_top_p_over_a_large_vocabulary_keeps_vllms_set(scale: float) -> None:
    # 4,000 tokens: a flat row's nucleus runs past the 1,024 candidates, a peaked one's not
    logits_NV = scale * torch.randn(16, 4000, generator=torch.Generator().manual_seed(0))
    expected = _vllm_top_p(logits_NV, 0.8)
    _, shaped_NV = shape_(logits_NV.clone(), TokenDistribution(top_p=0.8))
    assert torch.equal(torch.isfinite(shaped_NV), expected)
    kept = expected.sum(dim=-1)
    assert (kept > 1024).all() if scale < 1 else (kept < 1024).all()


def test_a_cut_inside_a_block_of_ties_keeps_as_many_as_vllm() -> None:
    # logits 2, 1, 1, 1, 1, 0: probabilities e^2 / Z, e / Z (x4), 1 / Z, Z = e^2 + 4e + 1.
    # Ascending, the cumulative masses are 1/Z, (1 + e)/Z, (1 + 2e)/Z, (1 + 3e)/Z, ... =
    # 0.052, 0.193, 0.334, 0.475, 0.616, 1: top_p 0.6 drops those <= 0.4, the 0 and the first
    # two of the tied 1s in sort order. vLLM keeps the 2 and two 1s, whichever two its sort
    # puts last; every kept 1's log-prob is 1 - log(e^2 + 2e) (all four kept: 1 - log(e^2 + 4e)).
    logits_1V = torch.tensor([[1.0, 1.0, 2.0, 1.0, 0.0, 1.0]])
    distribution = TokenDistribution(top_p=0.6)
    _, shaped_1V = shape_(logits_1V.clone(), distribution)
    # the sampler's set: the lowest-id ties dropped first
    assert torch.isfinite(shaped_1V[0]).tolist() == [False, False, True, True, False, True]
    expected = 1.0 - math.log(math.e**2 + 2 * math.e)
    # scoring any tied token keeps it and one other tie: the same log-prob for all four
    for token in (0, 1, 3, 5):
        _, scored_1V = shape_(logits_1V.clone(), distribution, keep_N=torch.tensor([token]))
        assert int(torch.isfinite(scored_1V).sum()) == 3
        assert scored_1V[0, token] == 1.0
        logp = torch.log_softmax(scored_1V, dim=-1)[0, token].item()
        assert logp == pytest.approx(expected, abs=1e-6)
    assert expected - (1.0 - math.log(math.e**2 + 4 * math.e)) > 0.35  # what keeping all cost


def _vllm_cut_logps(logits_NV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probs under vLLM's sort path, worked from its definition: sort ascending, ``-inf``
    below the k-th largest, then drop positions (not values) while the cumulative probability
    is at most 1 - p, the last always kept; ``-inf`` for dropped tokens."""
    ascending, order = logits_NV.sort(dim=-1)
    kth = ascending[:, -top_k : -top_k + 1]
    ascending = ascending.masked_fill(ascending < kth, -float("inf"))
    dropped = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
    dropped[:, -1] = False
    ascending = ascending.masked_fill(dropped, -float("inf"))
    shaped = torch.empty_like(logits_NV).scatter_(-1, order, ascending)
    return torch.log_softmax(shaped, dim=-1)


def test_bf16_rounded_logits_are_cut_as_vllm_cuts_them() -> None:
    # bf16 keeps 8 bits of mantissa: a 32,000-token row has blocks of equal logits, and a
    # top_p cut often falls inside one. Every token vLLM kept (it can sample only those) must
    # get vLLM's log-prob when the trainer scores it.
    generator = torch.Generator().manual_seed(0)
    logits_NV = (4 * torch.randn(400, 32000, generator=generator)).bfloat16().float() / 0.7
    reference = _vllm_cut_logps(logits_NV, top_k=40, top_p=0.8)
    kept_NV = torch.isfinite(reference)
    distribution = TokenDistribution(top_k=40, top_p=0.8)
    _, sampler_NV = shape_(logits_NV.clone(), distribution)
    # the sampler keeps as many tokens per row as vLLM, and the same ones outside ties
    assert torch.equal(torch.isfinite(sampler_NV).sum(-1), kept_NV.sum(-1))
    for rank in range(3):  # score the 1st, 2nd and 3rd likeliest kept token of every row
        token_N = reference.masked_fill(~kept_NV, -float("inf")).topk(rank + 1).indices[:, -1]
        token_N = torch.where(kept_NV.gather(-1, token_N[:, None])[:, 0], token_N, 0)
        _, scored_NV = shape_(logits_NV.clone(), distribution, keep_N=token_N)
        got = torch.log_softmax(scored_NV, dim=-1).gather(-1, token_N[:, None])[:, 0]
        want = reference.gather(-1, token_N[:, None])[:, 0]
        rows = torch.isfinite(want)
        torch.testing.assert_close(got[rows], want[rows], rtol=0, atol=2e-6)
    # rows whose cut falls inside a tie block: the value at the cut has more tokens than
    # vLLM kept (40 of these 400: the case is common, not contrived)
    cut_N1 = logits_NV.masked_fill(~kept_NV, float("inf")).amin(-1, keepdim=True)
    at_cut_NV = logits_NV == cut_N1
    assert int((at_cut_NV.sum(-1) > (kept_NV & at_cut_NV).sum(-1)).sum()) >= 20
