"""One optimizer step over micro-batches: accumulate, sum the gradients over processes, step.

Every loop's learning step goes through :meth:`Learner.step`. The caller hands it the
micro-batches and a function giving each one's share of the global loss (already normalised
over the whole batch of every process, see :mod:`agile_llmenvs.training.losses`), so the
accumulated gradient is the gradient of the whole batch's loss, however it is split.

Gradients are not averaged by DDP: every micro-batch runs under ``no_sync``, and the
gradients are summed over processes once, after the last one. Processes may then hold
different numbers of micro-batches (a failed episode, a restarted one) without a hang, and
the per-token weights do not change with the number of processes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

__all__ = ["Learner", "micro_batch_slices", "reduce_sum"]

MicroBatch = TypeVar("MicroBatch")


@dataclass
class Learner:
    """The model, its optimizer and schedule, and how gradients are clipped.

    Attributes:
        accelerator: The run's ``accelerate.Accelerator``.
        model: The prepared (possibly DDP-wrapped) model.
        optimizer: The prepared optimizer.
        scheduler: The learning-rate schedule, stepped once per optimizer step.
        max_grad_norm: The gradient norm clip.
    """

    accelerator: Any
    model: Any
    optimizer: Any
    scheduler: Any
    max_grad_norm: float

    def step(
        self,
        micro_batches: Iterable[MicroBatch],
        loss_of: Callable[[MicroBatch], torch.Tensor],
    ) -> float:
        """Accumulate the gradient of ``loss_of`` over ``micro_batches``, then step once.

        Returns:
            The gradient norm before clipping.
        """
        accelerator = self.accelerator
        self.optimizer.zero_grad(set_to_none=False)
        for micro_batch in micro_batches:
            with accelerator.no_sync(self.model), accelerator.autocast():
                loss = loss_of(micro_batch)
                accelerator.backward(loss)
        self._sum_gradients()
        grad_norm = accelerator.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        return float(grad_norm)

    def _sum_gradients(self) -> None:
        """Sum every trainable parameter's gradient over processes, a bucket at a time."""
        if self.accelerator.num_processes == 1:
            return
        bucket: list[torch.Tensor] = []
        size = 0
        for param in self.model.parameters():
            if not param.requires_grad:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            bucket.append(param.grad)
            size += param.grad.numel()
            if size >= _BUCKET_ELEMENTS:
                _all_reduce_sum(bucket)
                bucket, size = [], 0
        if bucket:
            _all_reduce_sum(bucket)


#: Gradient elements summed in one collective (128 MB of fp32).
_BUCKET_ELEMENTS = 1 << 25


def _all_reduce_sum(grads: list[torch.Tensor]) -> None:
    """Sum ``grads`` over processes in place, through one flat buffer."""
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    torch.distributed.all_reduce(flat)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def micro_batch_slices(rows: int, micro_batch_size: int | None) -> list[slice]:
    """Consecutive slices of ``rows`` rows, ``micro_batch_size`` at most each (all at once
    when ``None``)."""
    size = micro_batch_size or max(rows, 1)
    return [slice(start, min(start + size, rows)) for start in range(0, rows, size)]


def reduce_sum(accelerator: Any, values: Sequence[float]) -> list[float]:
    """``values`` summed over processes (as they are on one process)."""
    if accelerator.num_processes == 1:
        return [float(v) for v in values]
    tensor = torch.tensor([float(v) for v in values], device=accelerator.device)
    return [float(v) for v in accelerator.reduce(tensor, reduction="sum").tolist()]
