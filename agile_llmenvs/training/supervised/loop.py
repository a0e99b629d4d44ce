"""The loop SFT and DPO share: draw a dataset batch, take one optimizer step on its loss.

The loss of a batch is a sum over its units (SFT: response tokens; DPO: preference pairs)
divided by their count over every process, so accumulating micro-batches of rows gives the
whole batch's gradient. Under FSDP a process with fewer micro-batches runs zero-loss passes;
an objective whose loss also runs a frozen reference (DPO) gives its own
(:class:`RunsAReference`), so that the reference's gathers are joined too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol, runtime_checkable

import torch

from agile_llmenvs.core.images import SampleImages, image_model_inputs
from agile_llmenvs.training.objective import scored_token_logps
from agile_llmenvs.training.policy import (
    Learner,
    micro_batch_slices,
    prepare_policy,
    reduce_sum,
    vision_processor,
)
from agile_llmenvs.training.run import (
    RunBook,
    RunPlan,
    RunSettings,
    TrainResult,
    in_run_folder,
    load_checkpoint,
)

__all__ = [
    "DatasetObjective",
    "RunsAReference",
    "dataset_update",
    "labelled_logps",
    "train_on_dataset",
]


class DatasetObjective(Protocol):
    """What SFT and DPO each define: how a batch splits, and one micro-batch's loss."""

    def rows(self, batch: Any) -> int:
        """Rows of ``batch`` that micro-batches are cut from (DPO: pairs)."""
        ...

    def units(self, batch: Any) -> float:
        """What the loss averages over in ``batch``: response tokens (SFT), pairs (DPO)."""
        ...

    def loss(
        self, model: Any, batch: Any, rows: slice, total_units: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """``rows``' summed loss over ``total_units`` (every process's), and sums to log."""
        ...

    def metrics(self, sums: dict[str, float], total_units: float) -> dict[str, float]:
        """The logged metrics from the step's summed values."""
        ...


@runtime_checkable
class RunsAReference(Protocol):
    """An objective whose loss runs a frozen reference as well as the policy (DPO)."""

    def idle_loss(self, model: Any) -> torch.Tensor:
        """A zero loss through ``model`` and the reference, in the order :meth:`loss` runs
        them: what a sharded process with no micro-batch left runs to join the others'."""
        ...


def labelled_logps(
    model: Any,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    labels_BT: torch.Tensor,
    *,
    chunk_tokens: int,
    images_B: Sequence[SampleImages | None] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the labelled (response) tokens, the rows cut to their longest.

    Args:
        images_B: The images row ``b`` shows (:attr:`SFTBatch.images_B` of these rows; empty
            when none does): the vision-language model's forward sees their pixels.

    Returns:
        ``(logps_BT, mask_BT)``, both ``[B, T - 1]``: position ``t`` scores token ``t + 1``.
    """
    width = int(attention_mask_BT.sum(dim=1).max())
    mask_BT = labels_BT[:, 1:width] != -100
    input_ids_BT = input_ids_BT[:, :width]
    scored = scored_token_logps(
        model,
        input_ids_BT,
        attention_mask_BT[:, :width],
        mask_BT,
        chunk_tokens=chunk_tokens,
        model_inputs=image_model_inputs(images_B, input_ids_BT, model),
    )
    return scored.logps_BT, mask_BT


def train_on_dataset(
    settings: RunSettings,
    *,
    resume: bool,
    metric_keys: tuple[str, ...],
    make_objective: Callable[[Any, Any], DatasetObjective],
    overwrite: bool = False,
) -> TrainResult:
    """Run ``max_steps`` optimizer steps over the run's dataset env.

    Args:
        settings: The run's (a manifest with ``env_type: dataset``).
        resume: Continue from the checkpoint in ``output_dir`` (a run already at
            ``max_steps`` is left as it is).
        metric_keys: Columns of ``metrics.csv``: ``step``, ``loss``, ``grad_norm``,
            ``learning_rate``, ``step_time_s`` and whatever the objective reports.
        make_objective: Called with the loaded model and the accelerator.
        overwrite: Replace the run ``output_dir`` holds (refused without it).

    Raises:
        CheckpointError: see :func:`~agile_llmenvs.training.run.folder.plan_run`.
    """
    train = partial(_train, settings, metric_keys, make_objective)
    return in_run_folder(settings, resume=resume, overwrite=overwrite, train=train)


def _train(
    settings: RunSettings,
    metric_keys: tuple[str, ...],
    make_objective: Callable[[Any, Any], DatasetObjective],
    plan: RunPlan,
) -> TrainResult:
    """:func:`train_on_dataset` in the folder ``plan`` holds."""
    learner, tokenizer = prepare_policy(settings.policy)
    accelerator = learner.accelerator
    objective = make_objective(accelerator.unwrap_model(learner.model), accelerator)
    env = _dataset_env(settings, tokenizer, accelerator)
    start_step = 0
    if plan.resume_from is not None:
        start_step, rank_state = load_checkpoint(settings.output_dir, learner)
        env.load_state_dict(rank_state["env"])
    book = RunBook.start(
        settings,
        plan,
        learner,
        tokenizer,
        lambda step: {"env": env.state_dict()},
        metric_keys=metric_keys,
        start_step=start_step,
    )
    learner.model.train()
    with book:
        for step in book.steps():
            row = _step(step, env, learner, objective, settings.micro_batch_size, metric_keys)
            book.record(row, {"loss": row["loss"]})
            if book.stop_requested():
                break
            book.save_if_due()
    return book.result(book.save(), ("loss",))


def _step(
    step: int,
    env: Any,
    learner: Learner,
    objective: DatasetObjective,
    micro_batch_size: int | None,
    metric_keys: tuple[str, ...],
) -> dict[str, float]:
    """Optimizer step ``step`` (0-based) on the env's next batch: the metrics row, in
    ``metric_keys`` order."""
    step_start = time.perf_counter()
    learning_rate = learner.scheduler.get_last_lr()[0]
    values = dataset_update(learner, env.next_batch(), objective, micro_batch_size)
    values.update(
        step=float(step + 1),
        learning_rate=learning_rate,
        step_time_s=time.perf_counter() - step_start,
    )
    return {key: values[key] for key in metric_keys}


def dataset_update(
    learner: Learner, batch: Any, objective: DatasetObjective, micro_batch_size: int | None
) -> dict[str, float]:
    """One optimizer step on ``batch``, accumulated over micro-batches of its rows.

    Args:
        learner: The policy, its optimizer and schedule.
        batch: This process's rows (an ``SFTBatch`` or a ``PreferenceBatch``).
        objective: The loss, and how ``batch`` splits into rows.
        micro_batch_size: Rows per forward/backward (``None``: the batch at once).

    Returns:
        ``loss``, ``grad_norm`` and the objective's metrics, over every process.
    """
    batch = batch.to(learner.accelerator.device)
    (total_units,) = reduce_sum(learner.accelerator, [objective.units(batch)])
    sums: dict[str, float] = {}

    def loss_of(rows: slice) -> torch.Tensor:
        loss, values = objective.loss(learner.model, batch, rows, total_units)
        for key, value in {"loss": float(loss.detach()), **values}.items():
            sums[key] = sums.get(key, 0.0) + value
        return loss

    micro_batches = micro_batch_slices(objective.rows(batch), micro_batch_size)
    idle_loss = None
    if isinstance(objective, RunsAReference):
        idle_loss = partial(objective.idle_loss, learner.model)
    grad_norm = learner.step(micro_batches, loss_of, idle_loss=idle_loss)
    keys = sorted(sums)
    sums = dict(zip(keys, reduce_sum(learner.accelerator, [sums[k] for k in keys]), strict=True))
    return {"loss": sums["loss"], "grad_norm": grad_norm, **objective.metrics(sums, total_units)}


def _dataset_env(settings: RunSettings, tokenizer: Any, accelerator: Any) -> Any:
    """This rank's share of the run's dataset env, in batches of ``batch_size`` rows."""
    from agile_llmenvs.envs import make_llm_env

    return make_llm_env(
        settings.env,
        tokenizer,
        data_batch_size_per_gpu=settings.batch_size,
        max_context_length=settings.max_model_len,
        vision_processor=vision_processor(settings.policy.model),
        seed=settings.seed,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
    )
