"""One optimizer step over micro-batches: accumulate, sum the gradients over processes, step.

Every loop's learning step goes through :meth:`Learner.step`. The caller hands it the
micro-batches and a function giving each one's share of the global loss (already normalised
over the whole batch of every process, see :mod:`agile_llmenvs.training.objective.losses`), so the
accumulated gradient is the gradient of the whole batch's loss, however it is split.

Gradients are not averaged by DDP: every micro-batch runs under ``no_sync``, and the
gradients are summed over processes once, after the last one. Processes may then hold
different numbers of micro-batches (a failed episode, a restarted one) without a hang, and
the per-token weights do not change with the number of processes. Under FSDP2 (a model
``fully_shard`` has wrapped) the gradients are reduce-scattered by FSDP in every backward:
the loss is scaled by the process count to undo its averaging, and a process with fewer
micro-batches runs zero-loss passes so that every process joins every collective (a loss that
also runs a sharded reference, DPO's, brings its own zero-loss pass through both).
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from agile_llmenvs.errors import NonFiniteUpdateError
from agile_llmenvs.training.policy.sharding import idle_forward, is_sharded, max_over_processes

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
        *,
        idle_loss: Callable[[], torch.Tensor] | None = None,
    ) -> float:
        """Accumulate the gradient of ``loss_of`` over ``micro_batches``, then step once.

        Args:
            micro_batches: This process's micro-batches.
            loss_of: A micro-batch's share of the global loss.
            idle_loss: Under FSDP, the zero loss of each pass this process runs for a
                micro-batch it lacks: it must run every sharded model ``loss_of`` runs, in
                the same order (default: one forward through the policy).

        Returns:
            The gradient norm before clipping.

        Raises:
            NonFiniteUpdateError: the gradient norm is not finite (no weight is changed).
        """
        accelerator = self.accelerator
        sharded = is_sharded(self.model)
        todo: list[MicroBatch | None] = list(micro_batches)
        if sharded:  # every process must run as many forward/backward passes (collectives)
            todo += [None] * (max_over_processes(len(todo), accelerator.device) - len(todo))
        no_loss = idle_loss or self._no_loss
        # FSDP averages gradients over processes; the losses are shares of a global sum
        scale = accelerator.num_processes if sharded else 1
        self.optimizer.zero_grad(set_to_none=False)
        for micro_batch in todo:
            sync = contextlib.nullcontext() if sharded else accelerator.no_sync(self.model)
            with sync, accelerator.autocast():
                loss = loss_of(micro_batch) if micro_batch is not None else no_loss()
                accelerator.backward(loss * scale)
        if not sharded:
            self._sum_gradients()
        grad_norm = float(accelerator.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))
        if not math.isfinite(grad_norm):  # the norm is global: every process stops alike
            self.optimizer.zero_grad(set_to_none=False)
            raise NonFiniteUpdateError(
                f"the gradient norm of this optimizer step is {grad_norm}: the loss or its "
                "gradient is not finite, and the step would write NaN into every weight. "
                "Stopped before the optimizer stepped: the weights and the last checkpoint are "
                "as they were. Look for a log-prob or reward out of range in this step's batch, "
                "or lower training.learning_rate"
            )
        self.optimizer.step()
        self.scheduler.step()
        return grad_norm

    def skip_step(self) -> None:
        """Move the schedule on as one optimizer step would, without one (a mini-batch with
        no scored token): the schedule counts every planned step, so a skipped one would
        leave it behind for the rest of the run."""
        with warnings.catch_warnings():
            # torch warns when the first scheduler step comes before any optimizer step
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"))
            self.scheduler.step()

    def _no_loss(self) -> torch.Tensor:
        """A zero loss through the whole model: a process with no rows left still takes part
        in FSDP's gathers and reductions."""
        return idle_forward(self.model, self.accelerator.device)

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
