"""The sampler :class:`~agile_llmenvs.backends.hf.HFBackend` hands ``transformers``' ``generate``.

It shapes the distribution (temperature, then top-k, then top-p, as ``transformers``' own
warpers would) and records, step by step, the log-prob of each sampled token under
``logits / temperature`` over the full vocabulary: what a trainer scoring the sampled ids
computes. Only one step's log-probs are held at a time, so memory is O(batch x vocab)
however long the completion, instead of one ``[B, V]`` tensor per token.

Imported lazily by ``hf.py``, so that importing the backends does not import ``torch``.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

__all__ = ["SampledLogprobs"]


class SampledLogprobs(LogitsProcessor):
    """A logits processor that samples at a temperature and records the sampled log-probs.

    Each call divides the scores by ``temperature``, keeps their log-softmax as the pending
    step, and returns them truncated by top-k and top-p. The token sampled from a step is only
    known at the next call (the last column of its ``input_ids``), so that is when the pending
    step's log-prob is gathered; :meth:`logprobs` gathers the last step's from the returned
    sequences. ``generate`` must add no warpers of its own (temperature 1, no top-k / top-p),
    or the distribution sampled would no longer be the one recorded here.

    Args:
        temperature: Scores are divided by it; ``1.0`` (greedy decoding) leaves them alone.
        top_k: Keep the ``top_k`` likeliest tokens; ``None`` keeps all.
        top_p: Keep the smallest set of tokens holding this much mass; ``1.0`` keeps all.
        forbidden: Ids never sampled (a vision-language model's image placeholders, which
            only the processor places). Like the truncation, this is not in the recorded
            log-probs: they stay the full vocabulary's, what the trainer computes.
    """

    def __init__(
        self,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        forbidden: tuple[int, ...] = (),
    ):
        self._temperature = temperature
        self._forbidden = list(forbidden)
        # The order (and min_tokens_to_keep=1) of transformers' own warpers when sampling.
        self._truncate = LogitsProcessorList()
        if top_k is not None:
            self._truncate.append(TopKLogitsWarper(top_k=top_k))
        if top_p < 1.0:
            self._truncate.append(TopPLogitsWarper(top_p=top_p))
        self._pending_BV: torch.Tensor | None = None
        self._pending_position = 0  # the column of input_ids its sampled token lands in
        self._sampled_B: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        """Record the previous step's sampled log-prob, and shape this step's distribution.

        Args:
            input_ids: ``[B, L]`` ids so far; the last column was sampled from the pending step.
            scores: ``[B, V]`` next-token logits.

        Returns:
            ``scores / temperature`` with the tokens outside top-k / top-p set to ``-inf``.
        """
        self._gather_pending(input_ids)
        scaled_BV = scores / self._temperature  # as TemperatureLogitsWarper computes it
        self._pending_BV = torch.log_softmax(scaled_BV.float(), dim=-1)
        self._pending_position = input_ids.shape[1]
        shaped_BV = self._truncate(input_ids, scaled_BV)
        if self._forbidden:
            shaped_BV[:, self._forbidden] = -float("inf")
        return shaped_BV

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
