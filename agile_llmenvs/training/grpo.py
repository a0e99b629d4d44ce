"""GRPO on a rollout env: sample groups, score them, and push up what beat its group.

One step: the collector plays ``batch_size`` groups of ``group_size`` episodes with the
current policy (an :class:`HFBackend` over the unwrapped model, no grad; or a vLLM engine
given the policy's weights after every step); each finished episode's advantage is its reward
minus the mean of its group's finished members (optionally over their std); then
:func:`~agile_llmenvs.training.grpo_update.grpo_update` takes ``num_iterations`` passes of
``mini_batches`` optimizer steps on PPO's clipped importance-ratio surrogate against the
sampler's own log-probs (plus ``beta`` times a k3 KL to the starting policy), each step
accumulated over micro-batches and normalised as ``loss_type`` says.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agile_llmenvs.backends.hf import HFBackend
from agile_llmenvs.backends.types import SamplingParams
from agile_llmenvs.llm_envs.collector import RolloutCollector
from agile_llmenvs.llm_envs.trajectory import RolloutBatch
from agile_llmenvs.specs import LLMEnvSpec, RunManifest, TrainingSpec
from agile_llmenvs.specs.manifest import VLLMGenerationSpec
from agile_llmenvs.training.checkpoint import load_checkpoint, save_checkpoint
from agile_llmenvs.training.common import (
    TrainResult,
    prepare_policy,
    reference_model,
    training_spec,
)
from agile_llmenvs.training.grpo_update import UpdateSettings, grpo_update
from agile_llmenvs.training.held_out import EVAL_METRICS, HeldOutEval
from agile_llmenvs.training.interrupt import StopRequest
from agile_llmenvs.training.learner import Learner
from agile_llmenvs.training.losses import group_advantages
from agile_llmenvs.training.metrics import MetricsWriter, plot_metrics
from agile_llmenvs.training.policy_batch import PolicyBatch, build_policy_batch
from agile_llmenvs.training.progress import Progress
from agile_llmenvs.training.rollout_log import ROLLOUTS_FILE, RolloutLog
from agile_llmenvs.training.run_folder import plan_run, start_run
from agile_llmenvs.training.sampling import Sampler
from agile_llmenvs.training.sharding import GenerationSync, is_sharded
from agile_llmenvs.training.vllm_engine import PolicyVLLMEngine

__all__ = ["GRPO_METRICS", "PolicyBatch", "build_policy_batch", "train_grpo"]

logger = logging.getLogger(__name__)

#: The columns of a GRPO run's ``metrics.csv``, in order.
GRPO_METRICS = (
    "step",
    "reward_mean",
    "reward_std",
    "informative_groups",
    "loss",
    "kl",
    "clip_fraction",
    "grad_norm",
    "tokens_per_s",
    "step_time_s",
    "gen_time_s",
    "env_time_s",
    "learn_time_s",
    "weight_sync_time_s",
    "ratio_mean",
    "ratio_max",
    "entropy",
    "failed_episodes",
    "dropped_groups",
    "learning_rate",
    *EVAL_METRICS,
)


@dataclass
class _Run:
    """What a GRPO run holds between steps (set up once by :func:`_setup`)."""

    learner: Learner
    tokenizer: Any
    reference: Any
    collector: RolloutCollector
    sampler: Sampler
    settings: UpdateSettings
    start_step: int
    engine: PolicyVLLMEngine | None = None
    keep_checkpoints: int | None = None
    held_out: HeldOutEval | None = None

    @property
    def accelerator(self) -> Any:
        """The run's ``accelerate.Accelerator``."""
        return self.learner.accelerator

    @property
    def model(self) -> Any:
        """The prepared policy."""
        return self.learner.model

    def close(self) -> None:
        """Release the env slots, the env hosts behind them (if any), and the vLLM engine."""
        self.collector.close()
        _close_factory(self.collector)
        if self.held_out is not None:
            self.held_out.close()
        if self.engine is not None:
            self.engine.close()


def _close_factory(collector: RolloutCollector) -> None:
    """Stop what the run's env factory holds (Ray env hosts have a ``close``)."""
    close = getattr(collector.env_factory, "close", None)
    if callable(close):
        close()


def train_grpo(
    manifest: RunManifest, *, resume: bool = False, overwrite: bool = False
) -> TrainResult:
    """Train the manifest's model with GRPO on its rollout env.

    Args:
        manifest: A run manifest with ``env_type: rollout`` and ``training.algorithm: grpo``.
        resume: Continue from the checkpoint in ``output_dir`` (the same task sequence, and
            ``metrics.csv`` appended to), if this manifest may
            (:data:`~agile_llmenvs.training.run_folder.RESUMABLE_CHANGES`); a run already at
            ``max_steps`` is left as it is.
        overwrite: Replace the run ``output_dir`` holds; without it (or ``resume``) a
            folder that holds a run is refused.

    Returns:
        The run's steps, metric rows and file locations.

    Raises:
        CheckpointError: ``output_dir`` holds a run and neither ``resume`` nor
            ``overwrite`` is set; or ``resume`` without a checkpoint there, or of a run this
            manifest may not resume.
        OptionalDependencyError: ``training.lora`` without ``peft``, or
            ``generation_backend: vllm`` without ``vllm``.
    """
    config = training_spec(manifest)
    plan = plan_run(manifest, resume=resume, overwrite=overwrite)
    if plan.complete:
        return plan.complete_result()
    output_dir = plan.output_dir
    run = _setup(manifest, output_dir, resume)
    try:
        start_run(plan, manifest, run.accelerator)
        with StopRequest() as stop:
            history = _train(run, manifest, output_dir, resume, stop)
        steps = run.start_step + len(history)
        checkpoint_dir = _save(output_dir, steps, run)
    finally:
        run.close()
    if run.accelerator.is_main_process:
        panels = ("reward_mean", "loss") + (("eval_reward_mean",) if config.eval_every else ())
        plot_metrics(output_dir / "metrics.csv", output_dir / "metrics.png", panels)
    stopped_by = stop.signal_name if steps < config.max_steps else None
    return TrainResult(
        output_dir, steps, history, output_dir / "metrics.csv", checkpoint_dir, stopped_by
    )


def _train(
    run: _Run, manifest: RunManifest, output_dir: Path, resume: bool, stop: StopRequest
) -> list[dict[str, float]]:
    """Run the steps left, writing each one's metrics and the periodic checkpoints; a
    SIGINT / SIGTERM ends the loop after the step it arrives in."""
    config = training_spec(manifest)
    main = run.accelerator.is_main_process
    writer = rollouts = None
    if main:
        writer = MetricsWriter(
            output_dir / "metrics.csv",
            GRPO_METRICS,
            resume_step=run.start_step if resume else None,
            tensorboard=config.tensorboard,
        )
        rollouts = RolloutLog(
            output_dir / ROLLOUTS_FILE,
            run.tokenizer,
            every=config.log_rollouts_every,
            count=config.log_rollouts_count,
            resume_step=run.start_step if resume else None,
        )
    history: list[dict[str, float]] = []
    progress = Progress("grpo", start=run.start_step, total=config.max_steps, enabled=main)
    try:
        for step in range(run.start_step, config.max_steps):
            # Sampling seeds follow the step, so a resumed run samples what the whole run would.
            seed = (manifest.seed * 1_000_003 + step) * 4096 + run.accelerator.process_index * 64
            row = _step(run, config, step + 1, seed, rollouts)
            row.update(_evaluate(run, step + 1))
            history.append(row)
            if writer is not None:
                writer.write(row)
            if (step + 1) % config.log_every == 0:
                progress.show(reward=row["reward_mean"], loss=row["loss"])
            progress.advance()
            if stop.requested(run.accelerator):
                break
            last = step + 1 == config.max_steps  # the final save follows
            if config.save_every and (step + 1) % config.save_every == 0 and not last:
                _save(output_dir, step + 1, run)
    finally:
        progress.close()
        if writer is not None:
            writer.close()
    return history


def _evaluate(run: _Run, step: int) -> dict[str, float]:
    """The held-out evaluation after ``step`` when one is due (NaN, an empty cell, if not)."""
    if run.held_out is None or not run.held_out.due(step):
        return dict.fromkeys(EVAL_METRICS, math.nan)
    policy = run.accelerator.unwrap_model(run.model)
    return run.held_out.run(policy, run.tokenizer, run.accelerator)


def _step(
    run: _Run, config: TrainingSpec, step: int, seed: int, rollouts: RolloutLog | None = None
) -> dict[str, float]:
    """One GRPO step: collect, score, learn, and (vLLM) send the new weights to the engine;
    ``rollouts`` (the main process's) then logs a few episodes when the step is due.

    ``env_time_s`` is everything but generation, learning and the weight sync: the envs,
    the harness, the collector, advantages and batch building.
    """
    step_start = time.perf_counter()
    rollout, rewards_GN = _collect(run, config, seed)
    finished_GN = torch.tensor([not t.failed for t in rollout.trajectories])
    finished_GN = finished_GN.view_as(rewards_GN)
    advantages_GN, kept_GN = group_advantages(
        rewards_GN, scale=config.scale_advantages, finished_GN=finished_GN
    )
    pad_id = run.tokenizer.pad_token_id or 0
    batch = build_policy_batch(rollout, advantages_GN.flatten(), pad_id, kept_GN.flatten().tolist())
    learning_rate = run.learner.scheduler.get_last_lr()[0]
    learn_start = time.perf_counter()
    losses = grpo_update(run.learner, batch.to(run.accelerator.device), run.settings, run.reference)
    learn_time = time.perf_counter() - learn_start
    sync_start = time.perf_counter()
    if run.engine is not None:
        run.engine.load_weights(run.accelerator.unwrap_model(run.model))
    sync_time = time.perf_counter() - sync_start
    step_time = time.perf_counter() - step_start
    timings = {
        "gen_time_s": run.sampler.seconds,
        "env_time_s": step_time - run.sampler.seconds - learn_time - sync_time,
        "learn_time_s": learn_time,
        "weight_sync_time_s": sync_time,
        "step_time_s": step_time,
    }
    counts = {
        "failed_episodes": float((~finished_GN).sum()),
        "dropped_groups": float((~kept_GN.any(dim=1)).sum()),
    }
    measured = {**losses, **timings, "learning_rate": learning_rate}
    if rollouts is not None:  # after the timings: decoding is not part of the step
        rollouts.maybe_write(step, rollout.trajectories)
    return _step_row(run, step, rewards_GN, finished_GN, batch, rollout, measured, counts)


def _step_row(
    run: _Run,
    step: int,
    rewards_GN: torch.Tensor,
    finished_GN: torch.Tensor,
    batch: PolicyBatch,
    rollout: RolloutBatch,
    measured: dict[str, float],
    counts: dict[str, float],
) -> dict[str, float]:
    """The step's metrics: means over processes, except counts (summed) and the throughput.

    Reward statistics are over the episodes that finished.
    """
    finished = rewards_GN[finished_GN]
    local = {
        "reward_mean": finished.mean().item() if finished.numel() else 0.0,
        "reward_std": finished.std(unbiased=False).item() if finished.numel() else 0.0,
        **measured,
    }
    row = _reduce(run.accelerator, local, "mean")
    totals = {
        "tokens": float(batch.action_mask_BT.sum()),
        "informative_groups": float(rollout.informative_groups),
        **counts,
    }
    totals = _reduce(run.accelerator, totals, "sum")
    row.update(
        step=float(step),
        tokens_per_s=totals.pop("tokens") / max(row["step_time_s"], 1e-9),
        **totals,
    )
    return row


def _setup(manifest: RunManifest, output_dir: Path, resume: bool) -> _Run:
    """Load the policy (and a reference when ``beta > 0``), the optimizer, the vLLM engine
    when asked for, and the collector; then the checkpoint when resuming."""
    config = training_spec(manifest)
    total_steps = config.max_steps * config.num_iterations * config.mini_batches
    learner, tokenizer = prepare_policy(manifest, config, total_steps=total_steps)
    accelerator = learner.accelerator
    policy = accelerator.unwrap_model(learner.model)
    reference = reference_model(policy, accelerator.device) if config.beta else None
    max_model_len = manifest.model.max_model_len or policy.config.max_position_embeddings
    engine = None
    if config.generation_backend == "vllm":
        engine = PolicyVLLMEngine(
            manifest,
            config.vllm or VLLMGenerationSpec(),
            max_model_len=max_model_len,
            num_processes=accelerator.num_processes,
        )
    params = SamplingParams(
        max_tokens=config.max_new_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
    )
    sampler = Sampler(
        engine.backend if engine else HFBackend.from_model(policy, tokenizer),
        params,
        sync=GenerationSync(accelerator.device) if is_sharded(policy) else None,
    )
    collector = None
    try:
        collector, max_turns = _make_collector(manifest, tokenizer, max_model_len, accelerator)
        start_step = 0
        if resume:
            start_step, rank_state = load_checkpoint(
                output_dir,
                accelerator=accelerator,
                model=learner.model,
                optimizer=learner.optimizer,
                scheduler=learner.scheduler,
            )
            collector.load_state_dict(rank_state["collector"])
        if engine is not None:
            engine.load_weights(policy)  # the checkpoint's, or the adapters merged in
        held_out = HeldOutEval.build(manifest, tokenizer, max_model_len, accelerator)
    except BaseException:
        if collector is not None:
            collector.close()
            _close_factory(collector)
        if engine is not None:
            engine.close()
        raise
    return _Run(
        learner,
        tokenizer,
        reference,
        collector,
        sampler,
        _update_settings(manifest, max_turns),
        start_step,
        engine,
        keep_checkpoints=config.keep_checkpoints,
        held_out=held_out,
    )


def _update_settings(manifest: RunManifest, max_turns: int) -> UpdateSettings:
    """The learning step's settings; ``max_turns`` is the env's turn budget, as the rollout
    factory found it (the manifest's, or what the env declares)."""
    config = training_spec(manifest)
    return UpdateSettings(
        loss_type=config.loss_type,
        clip_eps=config.clip_eps,
        beta=config.beta or 0.0,
        temperature=config.temperature,
        max_completion_tokens=config.max_completion_tokens or config.max_new_tokens * max_turns,
        micro_batch_size=config.micro_batch_size,
        num_iterations=config.num_iterations,
        mini_batches=config.mini_batches,
        chunk_tokens=config.logps_chunk_tokens,
    )


def _make_collector(
    manifest: RunManifest, tokenizer: Any, max_model_len: int, accelerator: Any
) -> tuple[RolloutCollector, int]:
    """This rank's collector over the manifest's rollout env, and the env's turn budget."""
    from agile_llmenvs.envs import make_rollout_env_factory

    config = training_spec(manifest)
    env_spec = manifest.env
    assert isinstance(env_spec, LLMEnvSpec)  # the manifest validator pairs grpo with rollout
    env_factory, max_turns = make_rollout_env_factory(
        env_spec,
        tokenizer,
        max_model_len=max_model_len,
        max_output_tokens=config.max_new_tokens,
        seed=manifest.seed,
    )
    collector = RolloutCollector(
        env_factory,
        config.batch_size,
        config.group_size,
        base_seed=manifest.seed,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
        adaptive_task_sampling=env_spec.adaptive_task_sampling,
    )
    return collector, max_turns


def _collect(run: _Run, config: TrainingSpec, seed: int) -> tuple[RolloutBatch, torch.Tensor]:
    """Play one batch of groups with the current policy; returns it and its rewards ``[G, N]``."""
    run.sampler.params = dataclasses.replace(run.sampler.params, seed=seed)
    run.sampler.seconds, run.sampler.calls = 0.0, 0
    run.accelerator.unwrap_model(run.model).eval()
    with torch.no_grad():
        rollout = run.collector.collect(run.sampler, dynamic_sampling=config.dynamic_sampling)
        run.sampler.drain()
    rewards_GN = torch.tensor([t.reward for t in rollout.trajectories])
    return rollout, rewards_GN.view(-1, config.group_size)


def _save(output_dir: Path, step: int, run: _Run) -> Path:
    return save_checkpoint(
        output_dir,
        step=step,
        accelerator=run.accelerator,
        model=run.model,
        optimizer=run.learner.optimizer,
        tokenizer=run.tokenizer,
        rank_state={"collector": run.collector.state_dict()},
        scheduler=run.learner.scheduler,
        keep=run.keep_checkpoints,
    )


def _reduce(accelerator: Any, values: dict[str, float], reduction: str) -> dict[str, float]:
    """Reduce each metric over processes (``"mean"`` or ``"sum"``; identity on one process)."""
    if accelerator.num_processes == 1:
        return {key: float(value) for key, value in values.items()}
    tensor = torch.tensor([float(v) for v in values.values()], device=accelerator.device)
    reduced = accelerator.reduce(tensor, reduction=reduction).tolist()
    return dict(zip(values, reduced, strict=True))
