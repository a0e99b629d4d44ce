"""The HF backend draws each token itself (``_hf_sampling.draw``: the inverse of each row's
cumulative weights at one uniform draw) instead of ``generate``'s ``torch.multinomial``:
frequencies against weights given by hand, ids of weight 0 never drawn, the edges of the
uniform draw, and the backend's sampled ids against the log-probs it records."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch
from fakes import digit_messages

from agile_llmenvs.backends import HFBackend, SamplingParams, _hf_sampling
from agile_llmenvs.backends._hf_sampling import draw

ROWS = 200_000


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        ([0.5, 0.3, 0.0, 0.15, 0.05], [0.5, 0.3, 0.0, 0.15, 0.05]),
        ([2.0, 0.0, 6.0], [0.25, 0.0, 0.75]),  # weights need not sum to 1
    ],
)
def test_ids_are_drawn_in_proportion_to_their_weights(
    weights: list[float], expected: list[float]
) -> None:
    torch.manual_seed(0)
    ids = draw(torch.tensor([weights]).expand(ROWS, -1))
    counts = torch.bincount(ids, minlength=len(weights)).tolist()
    for count, p in zip(counts, expected, strict=True):
        if p == 0:
            assert count == 0
            continue
        sigma = math.sqrt(p * (1 - p) / ROWS)
        assert abs(count / ROWS - p) < 5 * sigma, (counts, expected)


def test_rows_are_drawn_from_their_own_weights() -> None:
    torch.manual_seed(1)
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]).repeat(100, 1)
    assert draw(probs).tolist() == [1, 2, 0] * 100


@pytest.mark.parametrize(("u", "expected"), [(0.0, 1), (1.0, 2)])
def test_a_draw_at_either_end_of_the_uniform_lands_on_an_id_of_weight(
    monkeypatch: pytest.MonkeyPatch, u: float, expected: int
) -> None:
    """u = 0 passes the leading zero weight (the first id whose cumulative weight exceeds 0);
    u = 1 (a product rounded up to the total) would land past the end, and takes the last id
    of weight instead of the trailing zero."""

    def fixed(size: Any, **kwargs: Any) -> torch.Tensor:
        return torch.full(size, u, dtype=kwargs["dtype"])

    monkeypatch.setattr(_hf_sampling.torch, "rand", fixed)
    assert draw(torch.tensor([[0.0, 0.4, 0.6, 0.0]])).tolist() == [expected]


def test_a_seed_fixes_the_draws() -> None:
    probs = torch.softmax(torch.randn(64, 50), dim=-1)
    torch.manual_seed(3)
    first = draw(probs)
    torch.manual_seed(3)
    assert torch.equal(draw(probs), first)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=1, seed=5),
        SamplingParams(max_tokens=1, seed=5, temperature=0.7, top_k=20, top_p=0.9),
    ],
)
def test_the_backends_samples_follow_the_log_probs_it_records(
    hf_backend: HFBackend, params: SamplingParams
) -> None:
    """One prompt, 4,000 rows, one token each: every id's frequency is the probability its
    recorded log-prob gives (the distribution the trainer scores), within 5 sigma."""
    prompt = hf_backend.encode_chat(digit_messages(4)[0])
    rows = 4000
    generations = hf_backend.generate([prompt] * rows, params)
    counts = Counter(g.token_ids[0] for g in generations)
    probability = {g.token_ids[0]: math.exp(g.logprobs[0]) for g in generations}
    assert len(probability) > 5  # a spread distribution, not one id
    for token, count in counts.items():
        p = probability[token]
        sigma = math.sqrt(p * (1 - p) / rows)
        assert abs(count / rows - p) < 5 * sigma + 1e-9, (token, count, p)
    # what was never drawn had little mass: the drawn ids' probabilities cover the rest
    assert sum(probability.values()) > 0.99


@pytest.mark.parametrize(
    "weights", [[math.nan, 1.0], [math.inf, 1.0], [0.0, 0.0]], ids=["nan", "inf", "no weight"]
)
def test_a_row_of_no_finite_weight_is_refused(weights: list[float]) -> None:
    with pytest.raises(ValueError, match="the policy's logits are not finite"):
        draw(torch.tensor([[0.5, 0.5], weights]))
