"""The sampler :class:`~agile_llmenvs.backends.hf.HFBackend` hands ``transformers``' ``generate``.

It shapes the distribution as a :class:`~agile_llmenvs.backends.types.TokenDistribution`
says (repetition penalty, temperature, then ``min_p``, ``top_k`` and ``top_p``, in vLLM's
order, with the trainer's own functions) and records, step by step, the log-prob of each
sampled token under it: what a trainer scoring the sampled ids computes. When it samples, it
draws the token itself, by inverting each row's cumulative distribution at one uniform draw
(:func:`draw`), and hands ``generate`` (run greedy) scores whose only finite entry is that
token: ``generate``'s own sampler, ``torch.multinomial`` without replacement, costs 0.6 ms
a step for 64 rows of the tiny model's 450 ids on one CPU thread (it draws an exponential per
id), the inversion 0.04 ms. Only one step's
log-probs are held at a time, so memory is O(batch x vocab) however long the completion,
instead of one ``[B, V]`` tensor per token.

Imported lazily by ``hf.py``, so that importing the backends does not import ``torch``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessor

from agile_llmenvs.backends._shaping import context_mask, penalize_, shape_
from agile_llmenvs.backends.types import TokenDistribution

__all__ = ["SampledLogprobs", "draw"]


def draw(probs_BV: torch.Tensor) -> torch.Tensor:
    """One id per row of ``probs_BV`` (non-negative weights, each row with one above 0),
    drawn with probability proportional to its weight, from the default generator of the
    rows' device: the first id whose cumulative weight (summed in float64) passes a uniform
    draw over the row's total. An id of weight 0 is never drawn.

    Returns:
        ``[B]`` long ids.

    Raises:
        ValueError: a row holds inf or NaN, or no weight above 0 (the policy's logits were
            not finite: ``torch.multinomial`` refuses such rows too).
    """
    cdf_BV = probs_BV.cumsum(dim=-1, dtype=torch.float64)
    total_B1 = cdf_BV[:, -1:]
    if not bool((torch.isfinite(total_B1) & (total_B1 > 0)).all()):
        raise ValueError(
            "the sampling distribution of a row holds inf or NaN, or no id of weight above "
            "0: the policy's logits are not finite (a diverged update, or weights that did "
            "not load)"
        )
    u_B1 = torch.rand((probs_BV.shape[0], 1), dtype=torch.float64, device=probs_BV.device)
    ids_B = torch.searchsorted(cdf_BV, u_B1 * total_B1, right=True)[:, 0]
    # a draw rounded up to the total would land past the end: take the last id of weight
    last_B = probs_BV.shape[1] - 1 - (probs_BV > 0).flip(-1).int().argmax(dim=-1)
    return torch.minimum(ids_B, last_B)


class SampledLogprobs(LogitsProcessor):
    """A logits processor that shapes the distribution and records the sampled log-probs.

    Each call shapes the scores and keeps the log-softmax of the distribution as the pending
    step (the truncated one when ``distribution.truncated``, else the whole vocabulary's),
    then returns the shaped scores to sample from. The token sampled from a step is only known
    at the next call (the last column of its ``input_ids``), so that is when the pending
    step's log-prob is gathered; :meth:`logprobs` gathers the last step's from the returned
    sequences. ``generate`` must add no processor of its own (temperature 1, no top-k / top-p,
    none from the model's ``generation_config``), or the distribution sampled would no
    longer be the one recorded here.

    Args:
        distribution: What shapes the scores.
        prompt_starts: The first real column of each row of the left-padded prompts: the
            repetition penalty counts the tokens from there on, not the padding.
        sample: Draw each step's token here (:func:`draw`) and return scores that are
            ``-inf`` but at it, for a greedy ``generate`` to pick; False: return the shaped
            scores (greedy decoding picks their argmax).
        forbidden: Ids never sampled (a vision-language model's image placeholders, which
            only the processor places). They are not in the recorded log-probs' set either
            way: those stay the distribution's, what the trainer computes.
    """

    def __init__(
        self,
        distribution: TokenDistribution,
        *,
        prompt_starts: Sequence[int] = (),
        forbidden: tuple[int, ...] = (),
        sample: bool = False,
    ):
        self._distribution = distribution
        self._sample = sample
        self._prompt_starts = list(prompt_starts)
        self._forbidden = list(forbidden)
        self._seen_BV: torch.Tensor | None = None  # the tokens in each row's context
        self._pending_BV: torch.Tensor | None = None
        self._pending_position = 0  # the column of input_ids its sampled token lands in
        self._sampled_B: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        """Record the previous step's sampled log-prob, and shape this step's distribution.

        Args:
            input_ids: ``[B, L]`` ids so far; the last column was sampled from the pending step.
            scores: ``[B, V]`` next-token logits.

        Returns:
            The shaped scores: ``-inf`` outside the kept set (and at the forbidden ids); when
            sampling, ``-inf`` but at the drawn token (0 there).
        """
        self._gather_pending(input_ids)
        logits_BV = scores.float()
        seen_BV = self._context(input_ids, scores)
        if seen_BV is not None:
            penalize_(logits_BV, seen_BV, self._distribution.repetition_penalty)
        scaled_BV, shaped_BV = shape_(logits_BV, self._distribution)
        recorded_BV = shaped_BV if self._distribution.truncated else scaled_BV
        self._pending_BV = torch.log_softmax(recorded_BV, dim=-1)
        self._pending_position = input_ids.shape[1]
        if self._forbidden:
            shaped_BV = shaped_BV.clone() if shaped_BV is scaled_BV else shaped_BV
            shaped_BV[:, self._forbidden] = -float("inf")
        if not self._sample:
            return shaped_BV
        ids_B1 = draw(torch.softmax(shaped_BV, dim=-1))[:, None]
        chosen_BV = torch.full_like(shaped_BV, -float("inf"))
        return chosen_BV.scatter_(1, ids_B1, 0.0)

    def _context(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor | None:
        """The tokens in each row's context, kept up to date one column a step (only under
        a repetition penalty)."""
        if not self._distribution.penalizes:
            return None
        rows, width = input_ids.shape
        if self._seen_BV is None:
            starts = self._prompt_starts or [0] * rows
            start_B = torch.tensor(starts, device=input_ids.device)
            # each row's ids from its first real column on, left-aligned
            columns_BL = (torch.arange(width, device=input_ids.device) + start_B[:, None]).clamp(
                max=width - 1
            )
            ids_BL = input_ids.gather(1, columns_BL)
            self._seen_BV = context_mask(ids_BL, width - start_B, scores.shape[-1])
        else:
            self._seen_BV.scatter_(1, input_ids[:, -1:], True)
        return self._seen_BV

    def logprobs(self, sequences: torch.Tensor, prompt_width: int) -> torch.Tensor:
        """The recorded log-prob of every generated token.

        Args:
            sequences: ``[B, prompt_width + T]`` ids that ``generate`` returned.
            prompt_width: Width of the (padded) prompt columns at the start of ``sequences``.

        Returns:
            ``[B, T]`` float32 log-probs, one per generated column of ``sequences``.
        """
        self._gather_pending(sequences)
        new_tokens = sequences.shape[1] - prompt_width
        if not self._sampled_B:
            return torch.zeros((sequences.shape[0], 0), device=sequences.device)
        # generate may undo steps it ran past a stop (deferred stop checks), hence the cut.
        return torch.stack(self._sampled_B, dim=1)[:, :new_tokens]

    def _gather_pending(self, ids: torch.Tensor) -> None:
        """Gather the pending step at the token ``ids`` holds for it, if it holds one yet."""
        if self._pending_BV is None or ids.shape[1] <= self._pending_position:
            return
        sampled_B1 = ids[:, self._pending_position, None].to(self._pending_BV.device)
        self._sampled_B.append(self._pending_BV.gather(-1, sampled_B1)[:, 0])
        self._pending_BV = None
