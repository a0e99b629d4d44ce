"""GRPO on a rollout env: sample groups, score them, and push up what beat its group.

One step: the collector plays ``batch_size`` groups of ``group_size`` episodes with the
current policy (an :class:`HFBackend` over the unwrapped model, no grad; or a vLLM engine
given the policy's weights after every step); each episode's advantage is its reward minus
its group's mean (optionally over the group's std); the loss is PPO's clipped
importance-ratio surrogate against the sampler's own log-probs, averaged over every sampled
token, plus ``beta`` times a k3 KL to the starting policy when ``beta > 0``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from agile_llmenvs.backends.hf import HFBackend
from agile_llmenvs.backends.types import Generation, SamplingParams
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
from agile_llmenvs.training.losses import (
    approx_kl,
    clipped_policy_loss,
    group_advantages,
    token_logps,
)
from agile_llmenvs.training.metrics import MetricsWriter, plot_metrics
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
)


@dataclass(frozen=True)
class PolicyBatch:
    """One rank's rollouts as right-padded training tensors; one row per token sample.

    Attributes:
        input_ids_BT: Each sample's token ids, then pad ids.
        attention_mask_BT: 1 on the sample's tokens.
        action_mask_BT: ``[B, T - 1]``; True where the next token was sampled by the policy.
        sampling_logps_BT: ``[B, T - 1]``; the sampler's log-prob of that token (0 elsewhere).
        advantages_B: The advantage of the episode each row belongs to.
    """

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    action_mask_BT: torch.Tensor
    sampling_logps_BT: torch.Tensor
    advantages_B: torch.Tensor

    def to(self, device: torch.device | str) -> PolicyBatch:
        """The same batch on ``device``."""
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)}
        return PolicyBatch(**moved)


def build_policy_batch(rollout: RolloutBatch, advantages: torch.Tensor, pad_id: int) -> PolicyBatch:
    """Lay out every token sample of ``rollout``, with its episode's advantage.

    An episode restarted into several samples gives several rows sharing one advantage; a
    failed episode gives none.
    """
    samples, row_advantages = [], []
    for trajectory, advantage in zip(rollout.trajectories, advantages.tolist(), strict=True):
        for sample in trajectory.episode.samples:
            samples.append(sample)
            row_advantages.append(advantage)
    rows = len(samples)
    width = max((len(sample.token_ids) for sample in samples), default=2)
    padded = [(sample, width - len(sample.token_ids)) for sample in samples]
    # flat numpy buffers: torch.tensor on Python lists costs ~4x as much
    ids = _flat(((*s.token_ids, *(pad_id,) * pad) for s, pad in padded), np.int64)
    actions = _flat(((*s.action_mask, *(False,) * pad) for s, pad in padded), np.bool_)
    sampled = _flat((sample.sampling_logps for sample in samples), np.float32)
    input_ids = torch.from_numpy(ids).view(rows, width)
    action_mask = torch.from_numpy(actions).view(rows, width - 1)
    lengths = torch.tensor([len(sample.token_ids) for sample in samples])
    attention_mask = (torch.arange(width) < lengths[:, None]).long()
    sampling_logps = torch.zeros(rows, width - 1)
    # each row's sampled tokens, in order, are its mask's True positions, rows in order
    sampling_logps[action_mask] = torch.from_numpy(sampled).nan_to_num(nan=0.0)
    advantages_B = torch.tensor(row_advantages, dtype=torch.float32)
    return PolicyBatch(input_ids, attention_mask, action_mask, sampling_logps, advantages_B)


def _flat(rows: Iterable[Iterable[Any]], dtype: type) -> np.ndarray:
    """The rows' values, concatenated, as one numpy array."""
    return np.fromiter(itertools.chain.from_iterable(rows), dtype=dtype)


class _Generator(Protocol):
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation]: ...


@dataclass
class _Sampler:
    """The collector's policy: one batched generate per turn, timed, seeded per call."""

    backend: _Generator
    params: SamplingParams
    seconds: float = 0.0
    calls: int = 0

    def __call__(
        self, contexts: list[list[int]]
    ) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
        start = time.perf_counter()
        seed = None if self.params.seed is None else self.params.seed + self.calls
        generations = self.backend.generate(contexts, dataclasses.replace(self.params, seed=seed))
        self.calls += 1
        self.seconds += time.perf_counter() - start
        return [(g.token_ids, g.logprobs) for g in generations]


@dataclass
class _Run:
    """What a GRPO run holds between steps (set up once by :func:`_setup`)."""

    accelerator: Any
    model: Any
    optimizer: torch.optim.Optimizer
    tokenizer: Any
    reference: Any
    collector: RolloutCollector
    sampler: _Sampler
    start_step: int
    engine: PolicyVLLMEngine | None = None

    def close(self) -> None:
        """Release the env slots, the env hosts behind them (if any), and the vLLM engine."""
        self.collector.close()
        _close_factory(self.collector)
        if self.engine is not None:
            self.engine.close()


def _close_factory(collector: RolloutCollector) -> None:
    """Stop what the run's env factory holds (Ray env hosts have a ``close``)."""
    close = getattr(collector.env_factory, "close", None)
    if callable(close):
        close()


def train_grpo(manifest: RunManifest, *, resume: bool = False) -> TrainResult:
    """Train the manifest's model with GRPO on its rollout env.

    Args:
        manifest: A run manifest with ``env_type: rollout`` and ``training.algorithm: grpo``.
        resume: Continue from the checkpoint in ``output_dir`` (the same task sequence, and
            ``metrics.csv`` appended to).

    Returns:
        The run's steps, metric rows and file locations.

    Raises:
        CheckpointError: ``resume`` without a checkpoint in ``output_dir``.
        OptionalDependencyError: ``training.lora`` without ``peft``, or
            ``generation_backend: vllm`` without ``vllm``.
    """
    config = training_spec(manifest)
    output_dir = Path(config.output_dir)
    run = _setup(manifest, output_dir, resume)
    try:
        history = _train(run, manifest, output_dir, resume)
        checkpoint_dir = _save(output_dir, config.max_steps, run)
    finally:
        run.close()
    if run.accelerator.is_main_process:
        plot_metrics(
            output_dir / "metrics.csv", output_dir / "metrics.png", ("reward_mean", "loss")
        )
    return TrainResult(
        output_dir, config.max_steps, history, output_dir / "metrics.csv", checkpoint_dir
    )


def _train(
    run: _Run, manifest: RunManifest, output_dir: Path, resume: bool
) -> list[dict[str, float]]:
    """Run the steps left, writing each one's metrics and the periodic checkpoints."""
    from tqdm import tqdm

    config = training_spec(manifest)
    main = run.accelerator.is_main_process
    writer = None
    if main:
        writer = MetricsWriter(
            output_dir / "metrics.csv",
            GRPO_METRICS,
            resume_step=run.start_step if resume else None,
            tensorboard=config.tensorboard,
        )
    history: list[dict[str, float]] = []
    steps = range(run.start_step, config.max_steps)
    progress = tqdm(
        steps, initial=run.start_step, total=config.max_steps, desc="grpo", disable=not main
    )
    try:
        for step in progress:
            # Sampling seeds follow the step, so a resumed run samples what the whole run would.
            seed = (manifest.seed * 1_000_003 + step) * 4096 + run.accelerator.process_index * 64
            row = _step(run, config, step + 1, seed)
            history.append(row)
            if writer is not None:
                writer.write(row)
            if (step + 1) % config.log_every == 0:
                progress.set_postfix(reward=f"{row['reward_mean']:.3f}", loss=f"{row['loss']:.4f}")
            if config.save_every and (step + 1) % config.save_every == 0:
                _save(output_dir, step + 1, run)
    finally:
        if writer is not None:
            writer.close()
    return history


def _step(run: _Run, config: TrainingSpec, step: int, seed: int) -> dict[str, float]:
    """One GRPO step: collect, score, learn, and (vLLM) send the new weights to the engine.

    ``env_time_s`` is everything but generation, learning and the weight sync: the envs,
    the harness, the collector, advantages and batch building.
    """
    step_start = time.perf_counter()
    rollout, rewards_GN = _collect(run, config, seed)
    advantages_GN = group_advantages(rewards_GN, scale=config.scale_advantages)
    pad_id = run.tokenizer.pad_token_id or 0
    batch = build_policy_batch(rollout, advantages_GN.flatten(), pad_id)
    learn_start = time.perf_counter()
    losses = _learn(run, config, batch.to(run.accelerator.device))
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
    return _step_row(run, step, rollout, rewards_GN, batch, {**losses, **timings})


def _step_row(
    run: _Run,
    step: int,
    rollout: RolloutBatch,
    rewards_GN: torch.Tensor,
    batch: PolicyBatch,
    measured: dict[str, float],
) -> dict[str, float]:
    """The step's metrics: means over processes, except counts (summed) and the throughput."""
    local = {
        "reward_mean": rewards_GN.mean().item(),
        "reward_std": rewards_GN.std(unbiased=False).item(),
        **measured,
    }
    row = _reduce(run.accelerator, local, "mean")
    totals = {"tokens": float(batch.action_mask_BT.sum()), "groups": rollout.informative_groups}
    totals = _reduce(run.accelerator, totals, "sum")
    row.update(
        step=float(step),
        tokens_per_s=totals["tokens"] / max(row["step_time_s"], 1e-9),
        informative_groups=totals["groups"],
    )
    return row


def _setup(manifest: RunManifest, output_dir: Path, resume: bool) -> _Run:
    """Load the policy (and a reference when ``beta > 0``), the optimizer, the vLLM engine
    when asked for, and the collector; then the checkpoint when resuming."""
    config = training_spec(manifest)
    accelerator, model, optimizer, tokenizer = prepare_policy(manifest, config)
    policy = accelerator.unwrap_model(model)
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
    params = SamplingParams(max_tokens=config.max_new_tokens, temperature=config.temperature)
    sampler = _Sampler(
        engine.backend if engine else HFBackend.from_model(policy, tokenizer), params
    )
    collector = None
    try:
        collector = _make_collector(manifest, tokenizer, max_model_len, accelerator)
        start_step = 0
        if resume:
            start_step, rank_state = load_checkpoint(
                output_dir, accelerator=accelerator, model=model, optimizer=optimizer
            )
            collector.load_state_dict(rank_state["collector"])
        if engine is not None:
            engine.load_weights(policy)  # the checkpoint's, or the adapters merged in
    except BaseException:
        if collector is not None:
            collector.close()
            _close_factory(collector)
        if engine is not None:
            engine.close()
        raise
    return _Run(
        accelerator, model, optimizer, tokenizer, reference, collector, sampler, start_step, engine
    )


def _make_collector(
    manifest: RunManifest, tokenizer: Any, max_model_len: int, accelerator: Any
) -> RolloutCollector:
    """This rank's collector over the manifest's rollout env."""
    from agile_llmenvs.envs import make_rollout_env_factory

    config = training_spec(manifest)
    env_spec = manifest.env
    assert isinstance(env_spec, LLMEnvSpec)  # the manifest validator pairs grpo with rollout
    env_factory, _ = make_rollout_env_factory(
        env_spec,
        tokenizer,
        max_model_len=max_model_len,
        max_output_tokens=config.max_new_tokens,
        seed=manifest.seed,
    )
    return RolloutCollector(
        env_factory,
        config.batch_size,
        config.group_size,
        base_seed=manifest.seed,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
        adaptive_task_sampling=env_spec.adaptive_task_sampling,
    )


def _collect(run: _Run, config: TrainingSpec, seed: int) -> tuple[RolloutBatch, torch.Tensor]:
    """Play one batch of groups with the current policy; returns it and its rewards ``[G, N]``."""
    run.sampler.params = dataclasses.replace(run.sampler.params, seed=seed)
    run.sampler.seconds, run.sampler.calls = 0.0, 0
    run.accelerator.unwrap_model(run.model).eval()
    with torch.no_grad():
        rollout = run.collector.collect(run.sampler, dynamic_sampling=config.dynamic_sampling)
    rewards_GN = torch.tensor([t.reward for t in rollout.trajectories])
    return rollout, rewards_GN.view(-1, config.group_size)


def _learn(run: _Run, config: TrainingSpec, batch: PolicyBatch) -> dict[str, float]:
    """One optimizer step on the clipped surrogate (+ beta * KL to the reference)."""
    run.model.train()
    logps_BT = token_logps(run.model, batch.input_ids_BT, batch.attention_mask_BT)
    policy_loss, clip_fraction = clipped_policy_loss(
        logps_BT,
        batch.sampling_logps_BT,
        batch.advantages_B,
        batch.action_mask_BT,
        clip_eps=config.clip_eps,
    )
    kl = torch.zeros(())
    if run.reference is not None:
        with torch.no_grad():
            ref_logps_BT = token_logps(run.reference, batch.input_ids_BT, batch.attention_mask_BT)
        kl = approx_kl(logps_BT, ref_logps_BT, batch.action_mask_BT)
    loss = policy_loss + (config.beta or 0.0) * kl
    run.optimizer.zero_grad()
    run.accelerator.backward(loss)
    grad_norm = run.accelerator.clip_grad_norm_(run.model.parameters(), config.max_grad_norm)
    run.optimizer.step()
    return {
        "loss": loss.item(),
        "kl": kl.item(),
        "clip_fraction": clip_fraction.item(),
        "grad_norm": float(grad_norm),
    }


def _save(output_dir: Path, step: int, run: _Run) -> Path:
    return save_checkpoint(
        output_dir,
        step=step,
        accelerator=run.accelerator,
        model=run.model,
        optimizer=run.optimizer,
        tokenizer=run.tokenizer,
        rank_state={"collector": run.collector.state_dict()},
    )


def _reduce(accelerator: Any, values: dict[str, float], reduction: str) -> dict[str, float]:
    """Reduce each metric over processes (``"mean"`` or ``"sum"``; identity on one process)."""
    if accelerator.num_processes == 1:
        return {key: float(value) for key, value in values.items()}
    tensor = torch.tensor([float(v) for v in values.values()], device=accelerator.device)
    reduced = accelerator.reduce(tensor, reduction=reduction).tolist()
    return dict(zip(values, reduced, strict=True))
