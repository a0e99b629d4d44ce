"""Log-probs of the scored tokens only, never a ``[B, T, V]`` tensor.

A causal LM's forward normally ends in ``lm_head`` over every position; at a real vocabulary
(151,936 for Qwen2) that one fp32 tensor is the largest thing in a learning step. Here the
decoder runs as usual (through the model's own ``forward``, so DDP and mixed precision see the
call), its last hidden state is caught on the way out, and the output layer is applied only to
the positions a loss scores, a chunk of ``chunk_tokens`` at a time, with a log-sum-exp. A
chunk's logits are recomputed in the backward pass instead of kept, so the peak is
``O(chunk_tokens x V)`` whatever the batch size or sequence length.

What the model's forward does to the output layer's logits (Gemma 2's soft cap, Granite's and
Cohere's scales) is applied to each chunk too: :func:`probe_logit_transform` finds it on the
first call for a model, and refuses a model whose logits it cannot reproduce. Then the
sampler's shaping (:class:`~agile_llmenvs.backends.types.TokenDistribution`: the repetition
penalty over each position's context, the temperature, the min-p / top-k / top-p truncation),
with the sampler's own functions, so the first pass scores what was sampled.

Under ``mixed_precision: bf16`` the matmuls run in bf16 and everything of size ``V`` in fp32;
the output layer's gradient is rounded to bf16 once per chunk and summed over the chunks in
fp32, so its error does not grow with the number of chunks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from agile_llmenvs.backends._shaping import context_mask, penalize_, shape_
from agile_llmenvs.backends.types import TokenDistribution
from agile_llmenvs.training.objective.logit_transform import LogitTransform, probe_logit_transform

__all__ = ["DEFAULT_CHUNK_TOKENS", "ScoredLogps", "probe_once", "scored_token_logps"]

#: Positions whose logits are held at once: 256 x 151,936 fp32 logits are 156 MB.
DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class ScoredLogps:
    """Per-position values, ``[B, T - 1]``, zero where a position is not scored.

    Attributes:
        logps_BT: The next token's log-prob under the sampling distribution; carries the
            gradient.
        entropy_BT: The entropy of that distribution (detached), when asked for.
    """

    logps_BT: torch.Tensor
    entropy_BT: torch.Tensor | None = None


def scored_token_logps(
    model: Any,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    score_mask_BT: torch.Tensor,
    *,
    distribution: TokenDistribution | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    with_entropy: bool = False,
    model_inputs: Mapping[str, Any] | None = None,
) -> ScoredLogps:
    """Log-probability of each scored next token under ``model``.

    Position ``t`` scores ``input_ids_BT[:, t + 1]`` (the harness's next-token aligned masks).

    Args:
        model: A Hugging Face causal LM, or that model wrapped by DDP / ``accelerate`` / peft.
        input_ids_BT: Right-padded token ids.
        attention_mask_BT: 1 on real tokens.
        score_mask_BT: ``[B, T - 1]``; True where the next token is scored (the action mask for
            GRPO, the labelled positions for SFT and DPO).
        distribution: What shaped the sampler's distribution (temperature, repetition
            penalty, truncation); the scored token is always in the kept set. None: the
            model's own log-softmax.
        chunk_tokens: Scored positions whose logits are computed at once.
        with_entropy: Also return each scored position's entropy (no gradient).
        model_inputs: Further inputs of the model's forward: a vision-language model's
            image inputs (:func:`~agile_llmenvs.core.images.image_model_inputs`).

    Raises:
        LogitTransformError: The model's forward changes the output layer's logits in a way
            this path cannot reproduce (checked once per model, on the first call).
    """
    distribution = distribution or TokenDistribution()
    hf_model = _unwrap(model)
    output_layer = hf_model.get_output_embeddings()
    transform = probe_logit_transform(model, hf_model, input_ids_BT.device)
    scored: list[ScoredLogps] = []

    def score(_decoder: Any, _inputs: Any, output: Any) -> None:
        # inside the model's forward: an FSDP root's own weights are gathered here
        hidden_BTH = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        scored.append(
            _score_hidden(
                hidden_BTH,
                input_ids_BT,
                score_mask_BT,
                output_layer,
                transform=transform,
                distribution=distribution,
                chunk_tokens=chunk_tokens,
                with_entropy=with_entropy,
            )
        )

    handle = hf_model.get_decoder().register_forward_hook(score)
    try:
        # the model itself runs (DDP, FSDP and autocast wrappers stay in the path), its own
        # output layer on one position only
        model(
            input_ids=input_ids_BT,
            attention_mask=attention_mask_BT,
            logits_to_keep=1,
            use_cache=False,
            **(model_inputs or {}),
        )
    finally:
        handle.remove()
    return scored[-1]


def _score_hidden(
    hidden_BTH: torch.Tensor,
    input_ids_BT: torch.Tensor,
    score_mask_BT: torch.Tensor,
    output_layer: Any,
    *,
    transform: LogitTransform,
    distribution: TokenDistribution,
    chunk_tokens: int,
    with_entropy: bool,
) -> ScoredLogps:
    """The output layer, then ``transform`` and the sampler's shaping, on the scored
    positions of ``hidden_BTH``, a chunk at a time."""
    rows_N, columns_N = score_mask_BT.nonzero(as_tuple=True)
    hidden_NH = hidden_BTH[:, :-1][rows_N, columns_N]
    targets_N = input_ids_BT[:, 1:][rows_N, columns_N]
    weight_VH, bias_V = output_layer.weight, output_layer.bias
    if _is_sharded(weight_VH):
        raise TypeError(
            "the output layer's weight is sharded while the decoder runs: shard the model's "
            "decoder layers and its root module only (the output layer in the root)"
        )
    if not distribution.truncates:  # the sampler's truncation is not in the log-probs
        distribution = dataclasses.replace(distribution, top_k=None, top_p=1.0, min_p=0.0)
    head = _Head(weight_VH, bias_V, transform, distribution)
    device = hidden_NH.device.type
    if torch.is_autocast_enabled(device):  # cast once, not once a chunk
        dtype = torch.get_autocast_dtype(device)
        hidden_NH = hidden_NH.to(dtype)
        head.weight_VH = weight_VH.detach().to(dtype)
        head.bias_V = bias_V.detach().to(dtype) if bias_V is not None else None
    logps, entropies = [], []
    for start in range(0, targets_N.shape[0], chunk_tokens):
        chunk = slice(start, start + chunk_tokens)
        # the context each position's repetition penalty counts: its row up to it
        context = _Context(input_ids_BT[rows_N[chunk]], columns_N[chunk] + 1)
        logp_N, entropy_N = _ChunkLogps.apply(
            hidden_NH[chunk], weight_VH, bias_V, targets_N[chunk], head, context, with_entropy
        )
        logps.append(logp_N)
        entropies.append(entropy_N)
    logps_BT = _scatter(logps, score_mask_BT, hidden_BTH)
    entropy_BT = _scatter(entropies, score_mask_BT, hidden_BTH).detach() if with_entropy else None
    return ScoredLogps(logps_BT, entropy_BT)


@dataclass
class _Head:
    """The output layer as a chunk computes it: its weight and bias in the compute dtype
    (bf16 copies under autocast, made once), the post-head transform and the shaping."""

    weight_VH: torch.Tensor
    bias_V: torch.Tensor | None
    transform: LogitTransform
    distribution: TokenDistribution

    def logits(
        self, hidden_NH: torch.Tensor, context: _Context, targets_N: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | float]:
        """``(scaled_NV, shaped_NV, slope)``: the shaped logits before and after the
        truncation (the same tensor without one), and ``d scaled / d head logits``."""
        with torch.autocast(hidden_NH.device.type, enabled=False):
            weight_VH = self.weight_VH.detach()
            bias_V = self.bias_V.detach() if self.bias_V is not None else None
            logits_NV = torch.nn.functional.linear(hidden_NH, weight_VH, bias_V).float()
        logits_NV = self.transform.apply_(logits_NV)
        slope = self.transform.slope(logits_NV)  # f'(y), before the logits are overwritten
        if self.distribution.penalizes:
            seen_NV = context.mask(logits_NV.shape[-1])
            slope = penalize_(logits_NV, seen_NV, self.distribution.repetition_penalty) * slope
        scaled_NV, shaped_NV = shape_(logits_NV, self.distribution, keep_N=targets_N)
        return scaled_NV, shaped_NV, slope / self.distribution.temperature


@dataclass(frozen=True)
class _Context:
    """Each scored position's context: the first ``lengths_N`` ids of its row, ``ids_NT``."""

    ids_NT: torch.Tensor
    lengths_N: torch.Tensor

    def mask(self, vocab_size: int) -> torch.Tensor:
        return context_mask(self.ids_NT, self.lengths_N, vocab_size)


class _ChunkLogps(torch.autograd.Function):
    """The log-prob of the target ids of one chunk of positions under the sampler's
    distribution: ``log softmax(keep(penalize(f(h W^T + b)) / T))``, ``f`` the model's
    post-head transform.

    Nothing of size ``V`` is kept for the backward pass: it recomputes the chunk's logits,
    and ``d logp / d y = (onehot(target) - softmax) * slope``, the slope that of ``f``, the
    penalty and the temperature (the truncation's kept set is constant), gives the gradients
    of the hidden states, the weight and the bias. The matmuls run in the compute dtype (bf16
    under ``mixed_precision: bf16``), the softmax in fp32, and the weight's and bias's
    gradients come back in their own dtype (fp32), so the chunks' sum is an fp32 one.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden_NH: torch.Tensor,
        weight_VH: torch.Tensor,
        bias_V: torch.Tensor | None,
        targets_N: torch.Tensor,
        head: _Head,
        context: _Context,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.head, ctx.context = head, context
        ctx.weight_dtype = weight_VH.dtype
        _, shaped_NV, _ = head.logits(hidden_NH, context, targets_N)
        logsumexp_N = torch.logsumexp(shaped_NV, dim=-1)
        logp_N = shaped_NV.gather(-1, targets_N[:, None])[:, 0] - logsumexp_N
        entropy_N = logp_N.new_zeros(())
        if with_entropy:
            # H = logsumexp - sum(p * logits), over the kept tokens only
            probs_NV = torch.softmax(shaped_NV, dim=-1)
            weighted_NV = probs_NV.mul_(shaped_NV.masked_fill(shaped_NV.isinf(), 0.0))
            entropy_N = logsumexp_N - weighted_NV.sum(dim=-1)
        ctx.save_for_backward(hidden_NH, targets_N, logsumexp_N)
        return logp_N, entropy_N

    @staticmethod
    def backward(
        ctx: Any, grad_logp_N: torch.Tensor, _grad_entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        hidden_NH, targets_N, logsumexp_N = ctx.saved_tensors
        head: _Head = ctx.head
        _, shaped_NV, slope = head.logits(hidden_NH, ctx.context, targets_N)
        # the logits' gradient, in place over them: -g * softmax, plus g at the target
        grad_NV = shaped_NV.sub_(logsumexp_N[:, None]).exp_().mul_(-grad_logp_N[:, None])
        grad_NV.scatter_add_(-1, targets_N[:, None], grad_logp_N[:, None])
        grad_NV = grad_NV.mul_(slope)
        grad_hidden = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_hidden = grad_NV.to(hidden_NH.dtype) @ head.weight_VH.detach()
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_NV.to(hidden_NH.dtype).t() @ hidden_NH).to(ctx.weight_dtype)
        if head.bias_V is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_NV.sum(dim=0).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _scatter(values: list[torch.Tensor], mask_BT: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The chunks' values laid back onto ``mask_BT``'s True positions, zero elsewhere."""
    out_BT = torch.zeros(mask_BT.shape, dtype=torch.float32, device=like.device)
    if values:
        out_BT = out_BT.masked_scatter(mask_BT, torch.cat(values))
    return out_BT


def _is_sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def probe_once(model: Any, device: torch.device) -> LogitTransform:
    """``model``'s post-head transform, probed on the first call for it
    (:func:`~agile_llmenvs.training.objective.logit_transform.probe_logit_transform`).

    A process that joins a sharded model's forwards without scoring (an idle pass) calls it
    too, so that the probe's forward, a collective under FSDP, runs on every process at the
    same point: before the first forward of ``model`` that any process scores or idles.
    """
    return probe_logit_transform(model, _unwrap(model), device)


def _unwrap(model: Any) -> Any:
    """The Hugging Face model inside DDP / FSDP (``.module``) and peft wrappers."""
    while hasattr(model, "module"):
        model = model.module
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model
