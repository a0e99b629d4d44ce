"""A :class:`~agile_llmenvs.backends.types.TokenDistribution` as tensor operations.

The HF backend's sampler and the trainer's scored path both shape logits with these
functions, so they keep the same tokens and compute the same log-probs. The operations and
their order are vLLM's (``vllm/v1/sample``: the repetition penalty on the raw logits, the
temperature, ``min_p``, then ``top_k`` and ``top_p``), so a vLLM engine or server samples the
same distribution too. Every ``[N, V]`` tensor is one row of logits per position.

Imported lazily by the backends, so that importing them does not import ``torch``.
"""

from __future__ import annotations

import torch

from agile_llmenvs.backends.types import TokenDistribution

__all__ = ["context_mask", "penalize_", "shape_"]


def context_mask(ids_NL: torch.Tensor, lengths_N: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[N, V]``: True for every token among the first ``lengths_N[n]`` ids of row ``n``.

    Args:
        ids_NL: Token ids; only each row's first ``lengths_N`` count.
        lengths_N: How many of each row's ids are context (at least 1).
        vocab_size: ``V``.
    """
    width = ids_NL.shape[1]
    counted_NL = torch.arange(width, device=ids_NL.device)[None, :] < lengths_N[:, None]
    # a column that does not count stands in for the row's first id, which does
    ids_NL = torch.where(counted_NL, ids_NL, ids_NL[:, :1])
    mask_NV = torch.zeros((ids_NL.shape[0], vocab_size), dtype=torch.bool, device=ids_NL.device)
    return mask_NV.scatter_(1, ids_NL, True)


def penalize_(logits_NV: torch.Tensor, seen_NV: torch.Tensor, penalty: float) -> torch.Tensor:
    """Apply the repetition penalty in place (vLLM's ``apply_repetition_penalties``): a
    positive logit of a token in the context is divided by ``penalty``, another multiplied.

    Returns:
        Each logit's factor, ``1 / penalty``, ``penalty`` or 1: also its derivative.
    """
    penalties_NV = torch.where(seen_NV, penalty, 1.0).to(logits_NV.dtype)
    scaling_NV = torch.where(logits_NV > 0, 1.0 / penalties_NV, penalties_NV)
    logits_NV.mul_(scaling_NV)
    return scaling_NV


def shape_(
    logits_NV: torch.Tensor, distribution: TokenDistribution, *, keep_N: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Divide ``logits_NV`` by the temperature in place, and truncate a copy, as
    ``distribution`` says (its repetition penalty is :func:`penalize_`'s, applied before).

    Args:
        logits_NV: fp32 logits (after the model's post-head transform and the penalty).
        distribution: The temperature and the truncation.
        keep_N: A token id per row kept whatever the truncation says (the trainer's scored
            token).

    Returns:
        ``(scaled_NV, shaped_NV)``: the logits over the temperature, and those logits with
        ``-inf`` outside the kept set: the same tensor when nothing truncates.
    """
    if distribution.temperature != 1.0:
        logits_NV.div_(distribution.temperature)
    if distribution.top_k is None and distribution.top_p >= 1.0 and distribution.min_p <= 0.0:
        return logits_NV, logits_NV
    shaped_NV = logits_NV.clone()
    if distribution.min_p > 0.0:
        probs_NV = torch.softmax(shaped_NV, dim=-1)
        floor_N1 = probs_NV.amax(dim=-1, keepdim=True).mul_(distribution.min_p)
        shaped_NV.masked_fill_(probs_NV < floor_N1, -float("inf"))
        del probs_NV
    _top_k_top_p_(shaped_NV, distribution.top_k, distribution.top_p, keep_N)
    if keep_N is not None:
        shaped_NV.scatter_(-1, keep_N[:, None], logits_NV.gather(-1, keep_N[:, None]))
    return logits_NV, shaped_NV


#: Top-p alone looks for its cut among this many likeliest tokens first (a sort of the whole
#: vocabulary only when they hold less than ``top_p`` of the mass).
TOP_P_CANDIDATES = 1024


def _top_k_top_p_(
    logits_NV: torch.Tensor, top_k: int | None, top_p: float, keep_N: torch.Tensor | None = None
) -> None:
    """vLLM's ``apply_top_k_top_p``, in place: ``-inf`` below the k-th largest logit (every
    token tied with it kept), then, over what is left, the least likely tokens whose
    cumulative probability stays within ``1 - top_p`` (the likeliest always kept).

    The top-p cut is positional, as vLLM's: in ascending order, a block of tied logits that
    the cut falls inside loses the tokens before the cut and keeps the rest. How many it keeps
    depends on the values alone; which ones, on the order vLLM's sort leaves ties in, which
    nothing fixes. Every kept token's log-prob depends only on how many: this keeps that many,
    dropping the tied tokens of lowest id first but never ``keep_N`` (the token the trainer
    scores, which the sampler kept).

    The top-p cut is found among candidates: the top-k survivors when there is a top-k, else
    the :data:`TOP_P_CANDIDATES` likeliest when they hold ``top_p`` of the mass (the tokens
    past them are dropped either way), else every token: a sort of the whole vocabulary only
    when nothing smaller will do.
    """
    vocab_size = logits_NV.shape[-1]
    top_k = top_k if top_k is not None and top_k < vocab_size else None
    if top_k is None and top_p >= 1.0:
        return
    if top_k is not None:
        kth_N1 = logits_NV.topk(top_k, dim=-1).values[:, -1:]
        logits_NV.masked_fill_(logits_NV < kth_N1, -float("inf"))
        if top_p >= 1.0:
            return
        width = int((logits_NV > -float("inf")).sum(dim=-1).max())  # k, or more with ties
    else:
        width = min(vocab_size, TOP_P_CANDIDATES)
    logsumexp_N1 = logits_NV.logsumexp(dim=-1, keepdim=True)
    ascending_NK = logits_NV.topk(width, dim=-1).values.flip(-1)
    probs_NK = (ascending_NK - logsumexp_N1).exp_()
    outside_N1 = (1.0 - probs_NK.sum(dim=-1, keepdim=True)).clamp_(min=0.0)
    if bool((outside_N1 > 1.0 - top_p).any()):  # the cut may lie past the candidates
        ascending_NK = logits_NV.sort(dim=-1).values
        probs_NK = (ascending_NK - logsumexp_N1).exp_()
        outside_N1 = torch.zeros_like(logsumexp_N1)
    # the mass of each candidate and every less likely token, the ones outside included
    cumulative_NK = probs_NK.cumsum_(dim=-1).add_(outside_N1)
    # 1 - p in fp32, as vLLM computes it from its fp32 tensor of p
    dropped_NK = cumulative_NK <= 1.0 - torch.tensor(top_p, dtype=torch.float32)
    dropped_NK[:, -1] = False  # at least the likeliest
    # the cut is monotone: the kept tokens are those from the first one not dropped on
    first_kept_N1 = (~dropped_NK).to(torch.uint8).argmax(dim=-1, keepdim=True)
    cut_N1 = ascending_NK.gather(-1, first_kept_N1)
    logits_NV.masked_fill_(logits_NV < cut_N1, -float("inf"))
    _drop_tied_(logits_NV, ascending_NK, first_kept_N1, cut_N1, keep_N)


def _drop_tied_(
    logits_NV: torch.Tensor,
    ascending_NK: torch.Tensor,
    first_kept_N1: torch.Tensor,
    cut_N1: torch.Tensor,
    keep_N: torch.Tensor | None,
) -> None:
    """Keep only as many tokens tied with the cut value as vLLM's positional cut keeps (those
    at or after it in ascending order), dropping the lowest ids first, never ``keep_N``."""
    positions_NK = torch.arange(ascending_NK.shape[-1], device=ascending_NK.device)
    tied_NK = ascending_NK == cut_N1
    kept_N1 = (tied_NK & (positions_NK >= first_kept_N1)).sum(dim=-1, keepdim=True)
    tied_NV = logits_NV == cut_N1  # with any tied tokens past the candidates
    surplus_N1 = tied_NV.sum(dim=-1, keepdim=True) - kept_N1
    if not bool((surplus_N1 > 0).any()):
        return
    if keep_N is not None:
        tied_NV.scatter_(-1, keep_N[:, None], False)
    rank_NV = tied_NV.cumsum(dim=-1)  # 1 for the lowest droppable id of each row
    logits_NV.masked_fill_(tied_NV & (rank_NV <= surplus_N1), -float("inf"))
