"""The loop SFT and DPO share: draw a dataset batch, take one optimizer step on its loss."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from agile_llmenvs.specs import LLMEnvSpec, RunManifest
from agile_llmenvs.specs.manifest import TrainingSpec
from agile_llmenvs.training.checkpoint import load_checkpoint, save_checkpoint
from agile_llmenvs.training.common import TrainResult, prepare_policy, training_spec
from agile_llmenvs.training.metrics import MetricsWriter, plot_metrics

__all__ = ["LossFn", "train_on_dataset"]

LossFn = Callable[[Any, Any], tuple[torch.Tensor, dict[str, float]]]
"""(model, batch on the device) -> the loss to minimise, and extra metrics of the step."""


def train_on_dataset(
    manifest: RunManifest,
    *,
    resume: bool,
    name: str,
    metric_keys: tuple[str, ...],
    make_loss: Callable[[Any, Any], LossFn],
) -> TrainResult:
    """Run ``max_steps`` optimizer steps over the manifest's dataset env.

    Args:
        manifest: A manifest with ``env_type: dataset``.
        resume: Continue from the checkpoint in ``output_dir``.
        name: The progress bar's label.
        metric_keys: Columns of ``metrics.csv``: ``step``, ``loss``, ``grad_norm``,
            ``step_time_s`` and whatever the loss function reports.
        make_loss: Called with the loaded model and the accelerator; returns the loss function.
    """
    from tqdm import tqdm

    config = training_spec(manifest)
    output_dir = Path(config.output_dir)
    accelerator, model, optimizer, tokenizer = prepare_policy(manifest, config)
    loss_fn = make_loss(accelerator.unwrap_model(model), accelerator)
    env = _dataset_env(manifest, tokenizer, accelerator)
    start_step = 0
    if resume:
        start_step, rank_state = load_checkpoint(
            output_dir, accelerator=accelerator, model=model, optimizer=optimizer
        )
        env.load_state_dict(rank_state["env"])
    main = accelerator.is_main_process
    writer = None
    if main:
        resume_step = start_step if resume else None
        writer = MetricsWriter(
            output_dir / "metrics.csv",
            metric_keys,
            resume_step=resume_step,
            tensorboard=config.tensorboard,
        )

    history: list[dict[str, float]] = []
    model.train()
    steps = range(start_step, config.max_steps)
    for step in tqdm(
        steps, initial=start_step, total=config.max_steps, desc=name, disable=not main
    ):
        step_start = time.perf_counter()
        loss, extra, grad_norm = _learn(env, accelerator, model, optimizer, loss_fn, config)
        row = {"step": float(step + 1), "loss": loss, "grad_norm": grad_norm}
        row.update(extra, step_time_s=time.perf_counter() - step_start)
        history.append(row)
        if writer is not None:
            writer.write(row)
        if config.save_every and (step + 1) % config.save_every == 0:
            _save(output_dir, step + 1, accelerator, model, optimizer, tokenizer, env)

    checkpoint_dir = _save(
        output_dir, config.max_steps, accelerator, model, optimizer, tokenizer, env
    )
    if writer is not None:
        writer.close()
    if main:
        plot_metrics(output_dir / "metrics.csv", output_dir / "metrics.png", ("loss",))
    return TrainResult(
        output_dir, config.max_steps, history, output_dir / "metrics.csv", checkpoint_dir
    )


def _learn(
    env: Any,
    accelerator: Any,
    model: Any,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    config: TrainingSpec,
) -> tuple[float, dict[str, float], float]:
    """One optimizer step on the env's next batch: the loss, its extra metrics, the grad norm."""
    batch = env.next_batch().to(accelerator.device)
    loss, extra = loss_fn(model, batch)
    optimizer.zero_grad()
    accelerator.backward(loss)
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
    optimizer.step()
    return loss.item(), extra, float(grad_norm)


def _dataset_env(manifest: RunManifest, tokenizer: Any, accelerator: Any) -> Any:
    """This rank's share of the manifest's dataset env, batched for the training spec."""
    from agile_llmenvs.envs import make_llm_env

    config = training_spec(manifest)
    assert isinstance(manifest.env, LLMEnvSpec)  # the manifest validator pairs sft/dpo with it
    return make_llm_env(
        manifest.env,
        tokenizer,
        data_batch_size_per_gpu=config.batch_size,
        max_context_length=manifest.model.max_model_len,
        seed=manifest.seed,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
    )


def _save(
    output_dir: Path,
    step: int,
    accelerator: Any,
    model: Any,
    optimizer: torch.optim.Optimizer,
    tokenizer: Any,
    env: Any,
) -> Path:
    return save_checkpoint(
        output_dir,
        step=step,
        accelerator=accelerator,
        model=model,
        optimizer=optimizer,
        tokenizer=tokenizer,
        rank_state={"env": env.state_dict()},
    )
