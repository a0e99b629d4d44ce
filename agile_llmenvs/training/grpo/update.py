"""GRPO's learning phase: ``num_iterations`` passes over a collected batch, each split into
``mini_batches`` optimizer steps, each accumulated over micro-batches of rows.

The behaviour policy is the sampler: its log-probs (at the sampling temperature) are the
denominator of every importance ratio, in every pass, so the clip engages from the second
optimizer step on. Rows without sampler log-probs are scored by the policy itself, once,
before the first update, and so are the reference's log-probs of the KL term. Under FSDP those
scoring passes are collectives too: a process with fewer micro-batches joins the others' with
idle forwards, and a process with no row to score joins a scoring some other process needs.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from agile_llmenvs.core.images import image_model_inputs
from agile_llmenvs.errors import NonFiniteUpdateError
from agile_llmenvs.training.grpo.policy_batch import PolicyBatch
from agile_llmenvs.training.objective import (
    PolicyTokenLoss,
    ScoredLogps,
    TokenCounts,
    policy_token_loss,
    scored_token_logps,
    token_weights,
)
from agile_llmenvs.training.policy import (
    Learner,
    any_process,
    idle_forward,
    is_sharded,
    max_over_processes,
    micro_batch_slices,
    reduce_sum,
)
from agile_llmenvs.training.run import UpdateSettings

__all__ = ["GRPO_UPDATE_METRICS", "grpo_update"]

#: The metrics :func:`grpo_update` returns.
GRPO_UPDATE_METRICS = (
    "loss",
    "kl",
    "clip_fraction",
    "ratio_mean",
    "ratio_max",
    "entropy",
    "grad_norm",
)


@dataclass
class _Totals:
    """Sums over the update's micro-batches, on this process.

    They stay tensors on the device until :func:`_metrics` reads them once: a ``float()`` per
    micro-batch would wait for the device every time.
    """

    loss: Any = 0.0
    tokens: Any = 0.0
    clipped: Any = 0.0
    ratio: Any = 0.0
    first_tokens: Any = 0.0
    kl: Any = 0.0
    entropy: Any = 0.0
    ratio_maxes: list[torch.Tensor] = field(default_factory=list)
    step_losses: list[Any] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)

    def add(
        self,
        loss: torch.Tensor,
        token_loss: PolicyTokenLoss,
        scored: ScoredLogps,
        mask_BT: torch.Tensor,
        *,
        first: bool,
    ) -> None:
        """Count one micro-batch: its loss, ratios and clips; KL and entropy on a first pass."""
        self.loss = self.loss + loss.detach()
        self.tokens = self.tokens + mask_BT.sum()
        self.clipped = self.clipped + (token_loss.clipped_BT & mask_BT).sum()
        self.ratio = self.ratio + (token_loss.ratio_BT * mask_BT).sum()
        self.ratio_maxes.append((token_loss.ratio_BT * mask_BT).max())  # ratios are > 0
        if first:
            assert scored.entropy_BT is not None
            self.first_tokens = self.first_tokens + mask_BT.sum()
            self.kl = self.kl + (token_loss.kl_BT * mask_BT).sum()
            self.entropy = self.entropy + (scored.entropy_BT * mask_BT).sum()


def grpo_update(
    learner: Learner, batch: PolicyBatch, settings: UpdateSettings, reference: Any = None
) -> dict[str, float]:
    """Learn from one collected batch: every pass, every mini-batch, one optimizer step.

    Args:
        learner: The policy, its optimizer and schedule.
        batch: This process's rows, on the learner's device.
        settings: Loss type, clip, passes, mini-batches, micro-batch size.
        reference: The frozen reference of the KL term (``None`` when ``beta`` is 0).

    Returns:
        :data:`GRPO_UPDATE_METRICS`, over every process: ``loss`` and ``grad_norm`` are means
        over the optimizer steps; ``clip_fraction`` and the ratio's mean and max are over
        every sampled token of every pass; ``kl`` and ``entropy`` are token means of the
        first pass.
    """
    learner.model.train()
    paired = is_sharded(learner.model)  # then so is the reference (or it is the policy)
    with learner.accelerator.autocast():  # the scoring passes compute as the update does
        batch = _with_behaviour_logps(learner.model, batch, settings, paired=paired)
        ref_logps_BT = None
        if reference is not None:
            ref_logps_BT = _score(reference, batch, settings, paired=paired)
    totals = _Totals()
    for iteration in range(settings.num_iterations):
        for rows in _mini_batch_rows(batch.rows, settings.mini_batches):
            micro_batches = [
                slice(rows.start + micro.start, rows.start + micro.stop)
                for micro in micro_batch_slices(rows.stop - rows.start, settings.micro_batch_size)
            ]
            counts = _token_counts(learner.accelerator, batch, rows, len(micro_batches), settings)
            if counts.tokens == 0:  # every process sees the same count, and skips together
                learner.skip_step()
                continue
            loss_of = partial(
                _micro_loss,
                learner.model,
                batch,
                counts=counts,
                settings=settings,
                ref_logps_BT=ref_logps_BT,
                totals=totals,
                first=iteration == 0,
            )
            loss_before = totals.loss
            totals.grad_norms.append(learner.step(micro_batches, loss_of))
            totals.step_losses.append(totals.loss - loss_before)
    return _metrics(learner.accelerator, totals)


def _micro_loss(
    model: Any,
    batch: PolicyBatch,
    rows: slice,
    *,
    counts: TokenCounts,
    settings: UpdateSettings,
    ref_logps_BT: torch.Tensor | None,
    totals: _Totals,
    first: bool,
) -> torch.Tensor:
    """One micro-batch's share of the global loss, recording its statistics in ``totals``."""
    micro = batch.select(rows)
    scored = _scored(model, micro, settings, with_entropy=first)
    ref = None
    if ref_logps_BT is not None:
        ref = ref_logps_BT[rows, : micro.action_mask_BT.shape[1]]
    token_loss = policy_token_loss(
        scored.logps_BT,
        micro.sampling_logps_BT,
        micro.advantages_B,
        clip_eps=settings.clip_eps,
        ref_logps_BT=ref,
        beta=settings.beta,
    )
    weights_BT = token_weights(settings.loss_type, micro.action_mask_BT, counts)
    loss = (token_loss.loss_BT * weights_BT).sum()
    totals.add(loss, token_loss, scored, micro.action_mask_BT, first=first)
    return loss


def _scored(
    model: Any, micro: PolicyBatch, settings: UpdateSettings, *, with_entropy: bool = False
) -> ScoredLogps:
    """``model``'s log-probs of the micro-batch's sampled tokens, under the sampler's
    distribution."""
    return scored_token_logps(
        model,
        micro.input_ids_BT,
        micro.attention_mask_BT,
        micro.action_mask_BT,
        distribution=settings.distribution,
        chunk_tokens=settings.chunk_tokens,
        with_entropy=with_entropy,
        model_inputs=image_model_inputs(micro.images_B, micro.input_ids_BT, model),
    )


def _with_behaviour_logps(
    model: Any, batch: PolicyBatch, settings: UpdateSettings, *, paired: bool
) -> PolicyBatch:
    """``batch`` with the policy's own log-probs where the sampler gave none (NaN).

    With ``paired`` (a sharded policy) every process scores when any process must.
    """
    _check_sampling_logps(batch, distributed=paired or torch.distributed.is_initialized())
    missing_BT = batch.sampling_logps_BT.isnan() & batch.action_mask_BT
    missing = bool(missing_BT.any())
    if paired:
        missing = any_process(missing, batch.input_ids_BT.device)
    if not missing:
        return batch
    own_BT = _score(model, batch, settings, paired=paired)
    sampling_BT = torch.where(missing_BT, own_BT, batch.sampling_logps_BT)
    return dataclasses.replace(batch, sampling_logps_BT=sampling_BT)


#: No sampled token has a lower log-prob (``p < 4e-44``, below float32's normal range): vLLM
#: writes -9999 for a ``-inf`` it cannot send.
SAMPLED_LOGP_FLOOR = -100.0


def _check_sampling_logps(batch: PolicyBatch, *, distributed: bool) -> None:
    """Refuse a batch whose sampler recorded a log-prob no sampled token can have: ``inf``,
    above 0 (by more than rounding), or below :data:`SAMPLED_LOGP_FLOOR` (NaN is a log-prob
    not recorded: the policy scores it). Every process decides alike.

    Raises:
        NonFiniteUpdateError: such a log-prob, on any process.
    """
    logps_BT = batch.sampling_logps_BT
    bad_BT = batch.action_mask_BT & ((logps_BT < SAMPLED_LOGP_FLOOR) | (logps_BT > 1e-3))
    bad = bool(bad_BT.any())
    if distributed:
        bad = any_process(bad, batch.input_ids_BT.device)
    if not bad:
        return
    where = bad_BT.nonzero()
    detail = "on another process"
    if len(where):
        row, position = where[0].tolist()
        detail = (
            f"{len(where)} of this process's sampled tokens, the first {logps_BT[row, position]} "
            f"(row {row}, position {position})"
        )
    raise NonFiniteUpdateError(
        f"the sampler recorded log-probs no sampled token can have ({detail}; a sampled "
        f"token's log-prob lies in [{SAMPLED_LOGP_FLOOR:g}, 0]): its ratio would be inf and "
        "the update NaN. Stopped before learning from them: the weights and the last "
        "checkpoint are as they were. The generation backend answers wrong (a vLLM server "
        "writes -9999 for -inf): check its version and --logprobs-mode processed_logprobs"
    )


def _score(
    model: Any, batch: PolicyBatch, settings: UpdateSettings, *, paired: bool
) -> torch.Tensor:
    """``model``'s log-probs of the batch's sampled tokens, ``[B, T - 1]``, without gradients.

    With ``paired`` (a sharded model) every process runs as many forwards as the one with the
    most micro-batches, the others' gathers joined with idle forwards.
    """
    out_BT = torch.zeros_like(batch.sampling_logps_BT)
    slices = micro_batch_slices(batch.rows, settings.micro_batch_size)
    # agreed before the first forward: a count taken after would meet the others' gathers
    idle = 0
    if paired:
        idle = max_over_processes(len(slices), batch.input_ids_BT.device) - len(slices)
    with torch.no_grad():
        for rows in slices:
            scored = _scored(model, batch.select(rows), settings)
            out_BT[rows, : scored.logps_BT.shape[1]] = scored.logps_BT
        for _ in range(idle):
            idle_forward(model, batch.input_ids_BT.device)
    return out_BT


def _mini_batch_rows(rows: int, mini_batches: int) -> list[slice]:
    """``mini_batches`` consecutive slices of ``rows`` (sizes differ by at most one)."""
    bounds = np.linspace(0, rows, mini_batches + 1).round().astype(int)
    return [slice(int(a), int(b)) for a, b in itertools.pairwise(bounds)]


def _token_counts(
    accelerator: Any,
    batch: PolicyBatch,
    rows: slice,
    micro_batches: int,
    settings: UpdateSettings,
) -> TokenCounts:
    """The normalising counts of one optimizer step's rows (``micro_batches`` of them on
    this process), over every process."""
    local_tokens = float(batch.action_mask_BT[rows].sum())
    global_rows, global_tokens = reduce_sum(accelerator, [rows.stop - rows.start, local_tokens])
    if accelerator.num_processes > 1:
        micro_batches = max_over_processes(micro_batches, accelerator.device)
    assert settings.max_completion_tokens is not None  # a run's setup gives the env's budget
    return TokenCounts(
        rows=int(global_rows),
        tokens=int(global_tokens),
        processes=accelerator.num_processes,
        micro_batches=micro_batches,
        max_completion_tokens=settings.max_completion_tokens,
    )


def _metrics(accelerator: Any, totals: _Totals) -> dict[str, float]:
    steps = len(totals.step_losses)
    sums = [
        totals.tokens,
        totals.clipped,
        totals.ratio,
        totals.first_tokens,
        totals.kl,
        totals.entropy,
        *totals.step_losses,
    ]
    tokens, clipped, ratio, first_tokens, kl, entropy, *losses = reduce_sum(accelerator, sums)
    local_max = max((float(m) for m in totals.ratio_maxes), default=0.0)
    ratio_max = torch.tensor(local_max, device=accelerator.device)
    if accelerator.num_processes > 1:
        torch.distributed.all_reduce(ratio_max, op=torch.distributed.ReduceOp.MAX)
    return {
        "loss": sum(losses) / max(steps, 1),
        "kl": kl / max(first_tokens, 1.0),
        "clip_fraction": clipped / max(tokens, 1.0),
        "ratio_mean": ratio / max(tokens, 1.0),
        "ratio_max": float(ratio_max),
        "entropy": entropy / max(first_tokens, 1.0),
        "grad_norm": sum(totals.grad_norms) / max(steps, 1),
    }
