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
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from agile_llmenvs._run_files import METRICS_FILE, METRICS_PLOT
from agile_llmenvs.core.images import SampleImages, image_model_inputs
from agile_llmenvs.specs import LLMEnvSpec, RunManifest, TrainingSpec
from agile_llmenvs.training.objective import scored_token_logps
from agile_llmenvs.training.policy import (
    Learner,
    micro_batch_slices,
    prepare_policy,
    reduce_sum,
    set_cpu_threads,
    vision_processor,
)
from agile_llmenvs.training.run import (
    MetricsWriter,
    Progress,
    RunPlan,
    StopRequest,
    TrainResult,
    load_checkpoint,
    open_trackers,
    plan_run,
    plot_metrics,
    save_checkpoint,
    start_run,
    tensorboard_setting,
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
    manifest: RunManifest,
    config: TrainingSpec,
    *,
    resume: bool,
    name: str,
    metric_keys: tuple[str, ...],
    make_objective: Callable[[Any, Any], DatasetObjective],
    overwrite: bool = False,
) -> TrainResult:
    """Run ``max_steps`` optimizer steps over the manifest's dataset env.

    Args:
        manifest: A manifest with ``env_type: dataset``.
        config: Its training section.
        resume: Continue from the checkpoint in ``output_dir`` (a run already at
            ``max_steps`` is left as it is).
        name: The progress bar's label.
        metric_keys: Columns of ``metrics.csv``: ``step``, ``loss``, ``grad_norm``,
            ``learning_rate``, ``step_time_s`` and whatever the objective reports.
        make_objective: Called with the loaded model and the accelerator.
        overwrite: Replace the run ``output_dir`` holds (refused without it).

    Raises:
        CheckpointError: see :func:`~agile_llmenvs.training.run.folder.plan_run`.
    """
    plan = plan_run(manifest, resume=resume, overwrite=overwrite)
    try:
        return _train(manifest, config, plan, name, metric_keys, make_objective)
    except BaseException:
        plan.abandon()  # a run that never finished a step leaves the folder as it was
        raise
    finally:
        plan.release()


def _train(
    manifest: RunManifest,
    config: TrainingSpec,
    plan: RunPlan,
    name: str,
    metric_keys: tuple[str, ...],
    make_objective: Callable[[Any, Any], DatasetObjective],
) -> TrainResult:
    """:func:`train_on_dataset` in the folder ``plan`` holds."""
    if plan.complete:
        return plan.complete_result()
    resume = plan.resume_from is not None
    output_dir = plan.output_dir
    learner, tokenizer = prepare_policy(manifest, config, total_steps=config.max_steps)
    accelerator = learner.accelerator
    set_cpu_threads(learner.model, config.cpu_threads, accelerator.device)
    start_run(plan, manifest, accelerator)
    objective = make_objective(accelerator.unwrap_model(learner.model), accelerator)
    env = _dataset_env(manifest, config, tokenizer, accelerator)
    start_step = _resume(output_dir, learner, env) if resume else 0
    main = accelerator.is_main_process
    writer = None
    if main:
        writer = MetricsWriter(
            output_dir / METRICS_FILE,
            metric_keys,
            resume_step=start_step if resume else None,
            tensorboard=tensorboard_setting(config),
            trackers=open_trackers(config, output_dir, resume=resume),
        )

    history: list[dict[str, float]] = []
    learner.model.train()
    progress = Progress(name, start=start_step, total=config.max_steps, enabled=main)
    try:  # the metrics file and the trackers are closed however the loop ends
        with StopRequest() as stop:
            for step in range(start_step, config.max_steps):
                row = _step(step, env, learner, objective, config, metric_keys)
                history.append(row)
                if writer is not None:
                    writer.write(row)
                if (step + 1) % config.log_every == 0:
                    progress.show(loss=row["loss"])
                progress.advance()
                if stop.requested(accelerator):
                    break
                last = step + 1 == config.max_steps  # the final save follows
                if config.save_every and (step + 1) % config.save_every == 0 and not last:
                    _save(output_dir, step + 1, learner, tokenizer, env, config.keep_checkpoints)
        progress.close()
        done = start_step + len(history)
        checkpoint_dir = _save(output_dir, done, learner, tokenizer, env, config.keep_checkpoints)
    finally:
        progress.close()
        if writer is not None:
            writer.close()
    if main:
        plot_metrics(output_dir / METRICS_FILE, output_dir / METRICS_PLOT, ("loss",))
    stopped_by = stop.signal_name if done < config.max_steps else None
    return TrainResult(
        output_dir, done, history, output_dir / METRICS_FILE, checkpoint_dir, stopped_by
    )


def _resume(output_dir: Path, learner: Learner, env: Any) -> int:
    """Load the newest complete checkpoint into the learner and the env; its step."""
    start_step, rank_state = load_checkpoint(
        output_dir,
        accelerator=learner.accelerator,
        model=learner.model,
        optimizer=learner.optimizer,
        scheduler=learner.scheduler,
    )
    env.load_state_dict(rank_state["env"])
    return start_step


def _step(
    step: int,
    env: Any,
    learner: Learner,
    objective: DatasetObjective,
    config: Any,
    metric_keys: tuple[str, ...],
) -> dict[str, float]:
    """One optimizer step on the env's next batch: the metrics row, in ``metric_keys`` order."""
    step_start = time.perf_counter()
    learning_rate = learner.scheduler.get_last_lr()[0]
    values = dataset_update(learner, env.next_batch(), objective, config.micro_batch_size)
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


def _dataset_env(
    manifest: RunManifest, config: TrainingSpec, tokenizer: Any, accelerator: Any
) -> Any:
    """This rank's share of the manifest's dataset env, batched for ``config``."""
    from agile_llmenvs.envs import make_llm_env

    assert isinstance(manifest.env, LLMEnvSpec)  # the manifest validator pairs sft/dpo with it
    return make_llm_env(
        manifest.env,
        tokenizer,
        data_batch_size_per_gpu=config.batch_size,
        max_context_length=manifest.model.max_model_len,
        vision_processor=vision_processor(manifest.model),
        seed=manifest.seed,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
    )


def _save(
    output_dir: Path, step: int, learner: Learner, tokenizer: Any, env: Any, keep: int | None
) -> Path:
    return save_checkpoint(
        output_dir,
        step=step,
        accelerator=learner.accelerator,
        model=learner.model,
        optimizer=learner.optimizer,
        tokenizer=tokenizer,
        rank_state={"env": env.state_dict()},
        scheduler=learner.scheduler,
        keep=keep,
    )
