"""GRPO on a rollout env: sample groups, score them, and push up what beat its group.

One step: the collector plays ``batch_size`` groups of ``group_size`` episodes with the
current policy (an :class:`HFBackend` over the unwrapped model, no grad; or a vLLM engine
given the policy's weights after every step), or ``vllm serve`` processes have played it ahead
within ``max_staleness`` policy versions (:mod:`~agile_llmenvs.training.generation.server_rollouts`;
groups with an older member are dropped); each finished episode's advantage is its reward
minus the mean of its group's finished members, over a std as ``scale_rewards`` says; then
:func:`~agile_llmenvs.training.grpo.update.grpo_update` takes ``num_iterations`` passes of
``mini_batches`` optimizer steps on PPO's clipped importance-ratio surrogate against the
sampler's own log-probs (plus ``beta`` times a k3 KL to the starting policy), each step
accumulated over micro-batches and normalised as ``loss_type`` says.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from functools import partial
from typing import Any

import torch

from agile_llmenvs._run_files import ROLLOUTS_FILE
from agile_llmenvs.core import RolloutBatch, Trajectory
from agile_llmenvs.errors import AgileLLMEnvsError
from agile_llmenvs.specs import RunManifest
from agile_llmenvs.training.credit import (
    StateValues,
    TurnAdvantages,
    collector_checkpoints,
    estimate_values,
)
from agile_llmenvs.training.generation.sync_check import probe_ids
from agile_llmenvs.training.grpo.held_out import EVAL_METRICS
from agile_llmenvs.training.grpo.policy_batch import PolicyBatch, build_policy_batch
from agile_llmenvs.training.grpo.setup import GRPORun, setup_run, step_seed, turn_signal
from agile_llmenvs.training.grpo.step_advantages import step_advantages
from agile_llmenvs.training.grpo.update import grpo_update
from agile_llmenvs.training.objective import group_rewards
from agile_llmenvs.training.run import (
    EnvFailures,
    RolloutLog,
    RunBook,
    RunPlan,
    RunSettings,
    TrainResult,
    in_run_folder,
)

__all__ = ["GRPO_METRICS", "train_grpo"]

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
    "sync_check_gap",
    "ratio_mean",
    "ratio_max",
    "entropy",
    "failed_episodes",
    "dropped_groups",
    "stale_groups",
    "policy_lag_max",
    "policy_tokens",
    "credit_tokens",
    "trained_tokens",
    "credit_states",
    "credit_over_budget",
    "credit_fallback_episodes",
    "credit_time_s",
    "credit_env_time_s",
    "learning_rate",
    *EVAL_METRICS,
)


def train_grpo(
    manifest: RunManifest, *, resume: bool = False, overwrite: bool = False
) -> TrainResult:
    """Train the manifest's model with GRPO on its rollout env.

    Args:
        manifest: A run manifest with ``env_type: rollout`` and ``training.algorithm: grpo``.
        resume: Continue from the checkpoint in ``output_dir`` (the same task sequence, and
            ``metrics.csv`` appended to), if this manifest may
            (:data:`~agile_llmenvs.training.run.folder.RESUMABLE_CHANGES`); a run already at
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
    settings = RunSettings.of(manifest)
    return in_run_folder(
        settings, resume=resume, overwrite=overwrite, train=partial(_run, settings)
    )


def _run(settings: RunSettings, plan: RunPlan) -> TrainResult:
    """:func:`train_grpo` in the folder ``plan`` holds."""
    run = setup_run(settings, resume=plan.resume_from is not None)
    try:
        book = RunBook.start(
            settings,
            plan,
            run.learner,
            run.processor or run.tokenizer,
            run.rank_state,
            metric_keys=GRPO_METRICS,
            start_step=run.start_step,
        )
        with book:
            _train(run, settings, book)
        checkpoint_dir = book.save()
    finally:
        run.close()
    panels = ("reward_mean", "loss") + (("eval_reward_mean",) if settings.held_out.every else ())
    return book.result(checkpoint_dir, panels)


def _train(run: GRPORun, settings: RunSettings, book: RunBook) -> None:
    """Run the steps left, each one's row kept by ``book``, which saves the periodic
    checkpoints; a SIGINT / SIGTERM ends the loop after the step it arrives in."""
    main = run.accelerator.is_main_process
    rollouts = None
    if main:
        rollouts = RolloutLog(
            settings.output_dir / ROLLOUTS_FILE,
            run.tokenizer,
            every=settings.logging.rollouts_every,
            count=settings.logging.rollouts_count,
            resume_step=book.resume_step,
        )
    limits = settings.failures
    failures = EnvFailures(
        limits.max_fraction, limits.max_steps, report=main, output_dir=settings.output_dir
    )
    episodes = settings.batch_size * settings.group_size
    for step in book.steps():
        step_rng = step_seed(settings.seed, step, run.accelerator.process_index)
        row = _step(run, settings, step + 1, step_rng, rollouts, failures)
        row.update(_evaluate(run, step + 1))
        shown: dict[str, float | str] = {"reward": row["reward_mean"], "loss": row["loss"]}
        if failures.seen:  # once the env has failed, each step's count, as the stop says it
            shown["failed"] = f"{int(row['failed_episodes'])}/{episodes}"
        book.record(row, shown)
        failures.check(step + 1, int(row["failed_episodes"]), episodes)
        _check_credit(run, settings, step + 1, row)
        if book.stop_requested():
            break
        book.save_if_due()


def _check_credit(run: GRPORun, settings: RunSettings, step: int, row: dict[str, float]) -> None:
    """Refuse a ``turn_mc`` run whose episodes all fall back to episode credit: once a step
    has multi-turn episodes and the run has valued no state yet, the env cannot be branched
    this way, and the run would cost ``turn_mc``'s time for episode credit's updates. The row
    is summed over processes, so every process decides alike.

    Raises:
        AgileLLMEnvsError: step ``step`` valued no state and had episodes fall back.
    """
    if settings.continuations is None or run.credit_valued:
        return
    if row["credit_states"] > 0:
        run.credit_valued = True
        return
    fallbacks = int(row["credit_fallback_episodes"])
    if fallbacks == 0 or row["credit_over_budget"] > 0:  # the budget's choice, not a refusal
        return
    reasons = "; ".join(run.credit_refusals.values()) or "no checkpoint was taken"
    branching = settings.continuations.branching
    raise AgileLLMEnvsError(
        f"training.credit: {settings.credit} valued no state at step {step}: all {fallbacks} "
        f"of its multi-turn episodes fell back to episode credit ({reasons}). Set "
        f"training.credit_branching (now {branching!r}) to one that can branch "
        "this env (docs/branching.md: `action_replay` for an env deterministic given its seed "
        "and task, `process_fork` for one whose episodes live in its own memory), or use "
        "`credit: anchor` (no branching) or `credit: episode`"
    )


def _evaluate(run: GRPORun, step: int) -> dict[str, float]:
    """The held-out evaluation after ``step`` when one is due (NaN, an empty cell, if not)."""
    if run.held_out is None or not run.held_out.due(step):
        return dict.fromkeys(EVAL_METRICS, math.nan)
    return run.held_out.run(run.policy, run.tokenizer, run.accelerator)


def _step(
    run: GRPORun,
    settings: RunSettings,
    step: int,
    seed: int,
    rollouts: RolloutLog | None = None,
    failures: EnvFailures | None = None,
) -> dict[str, float]:
    """One GRPO step: collect, score, learn, and (vLLM) send the new weights to the engine
    or the servers; ``rollouts`` (the main process's) then logs a few episodes when the step
    is due, and its failed ones always; ``failures`` reports new kinds of env failure.

    ``env_time_s`` is everything but generation, learning, the weight sync and the
    ``turn_mc`` continuations (``credit_time_s``): the envs, the harness, the collector,
    advantages and batch building. With servers the rollouts (and their continuations)
    were played ahead; ``gen_time_s`` is then the time this step waited for them, and
    ``credit_time_s`` the producer's time on the continuations, overlapping it.
    """
    step_start = time.perf_counter()
    rollout, rewards_GN, gen_time, values = _collect(run, settings, seed, step - 1)
    finished_GN = torch.tensor([not t.failed for t in rollout.trajectories])
    finished_GN = finished_GN.view_as(rewards_GN)
    fresh_GN = torch.ones_like(finished_GN)
    if run.server is not None:  # a stale group is dropped whole: its advantages are relative
        stale_G = torch.tensor(run.server.stale_groups(rollout, step - 1, values))
        fresh_GN &= ~stale_G[:, None]
    advantages_GN, kept_GN, turns = step_advantages(
        settings, run.accelerator, rollout, rewards_GN, finished_GN & fresh_GN, values
    )
    pad_id = run.tokenizer.pad_token_id or 0
    advantages_B = advantages_GN.flatten().float()  # centred in float64, trained in float32
    batch = build_policy_batch(
        rollout,
        advantages_B,
        pad_id,
        kept_GN.flatten().tolist(),
        turn_advantages=turns.per_turn if turns is not None else None,
        extra_rows=turns.branch_rows if turns is not None else (),
    )
    learning_rate = run.learner.scheduler.get_last_lr()[0]
    learn_start = time.perf_counter()
    losses = grpo_update(run.learner, batch.to(run.accelerator.device), run.update, run.reference)
    learn_time = time.perf_counter() - learn_start
    sync_start = time.perf_counter()
    gap = _sync(run, step, batch, sync_start - step_start)
    sync_time = time.perf_counter() - sync_start
    step_time = time.perf_counter() - step_start
    credit_time = values.seconds if values is not None else 0.0
    # with servers the continuations were played by the producer, inside gen_time's wait
    credit_in_step = credit_time if run.server is None else 0.0
    timings = {
        "credit_time_s": credit_time,
        "credit_env_time_s": values.env_seconds if values is not None else 0.0,
        "gen_time_s": gen_time,
        "env_time_s": step_time - gen_time - credit_in_step - learn_time - sync_time,
        "learn_time_s": learn_time,
        "weight_sync_time_s": sync_time,
        "step_time_s": step_time,
    }
    counts = {
        "failed_episodes": float((~finished_GN).sum()),
        "dropped_groups": float((~kept_GN.any(dim=1)).sum()),
        "stale_groups": float((~fresh_GN.all(dim=1)).sum()),
        "policy_tokens": float(sum(_sampled_tokens(t) for t in rollout.trajectories)),
        **_credit_counts(values, turns),
    }
    measured = {
        **losses,
        **timings,
        "sync_check_gap": gap,
        "learning_rate": learning_rate,
        "policy_lag_max": _policy_lag(rollout, kept_GN, step - 1),
    }
    if rollouts is not None:  # after the timings: decoding is not part of the step
        rollouts.maybe_write(step, rollout.trajectories)
    if failures is not None:
        failures.see(step, rollout.trajectories)
    return _step_row(run, step, rewards_GN, finished_GN, batch, rollout, measured, counts)


def _credit_counts(values: StateValues | None, turns: TurnAdvantages | None) -> dict[str, float]:
    """A step's turn-level credit counts (all 0 under ``credit: episode``)."""
    return {
        "credit_tokens": float(values.tokens if values is not None else 0),
        "credit_states": float(values.states if values is not None else 0),
        "credit_over_budget": float(values.over_budget if values is not None else 0),
        "credit_fallback_episodes": float(turns.fallback_episodes if turns is not None else 0),
    }


def _sync(run: GRPORun, step: int, batch: PolicyBatch, step_s: float) -> float:
    """Send the policy's new weights to the engine or the servers (when due), then check
    the sync when :class:`SyncCheck` says so; the check's gap, or NaN when none ran."""
    policy = run.policy
    if run.engine is not None:
        run.engine.load_weights(policy)
    synced = run.engine is not None
    if run.server is not None and run.server.sync_due(step):
        run.server.sync(policy, version=step)
        synced = True
    check = run.sync_check
    if not synced or check is None:
        return math.nan
    if not check.due(step_s, run.accelerator.device, main=run.accelerator.is_main_process):
        return math.nan
    ids = run.setup_probe
    if batch.rows:  # the last tokens of a row just trained on: sampled ones among them
        ids = probe_ids(batch.input_ids_BT[0], batch.attention_mask_BT[0])
    return check(policy, ids, run.sampler_logps, when=f"the weight sync after step {step}")


def _step_row(
    run: GRPORun,
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
        "trained_tokens": float(batch.action_mask_BT.sum()),
        "informative_groups": float(rollout.informative_groups),
        **counts,
    }
    totals = _reduce(run.accelerator, totals, "sum")
    row.update(
        step=float(step),
        tokens_per_s=totals["trained_tokens"] / max(row["step_time_s"], 1e-9),
        **totals,
    )
    return row


def _policy_lag(rollout: RolloutBatch, kept_GN: torch.Tensor, version: int) -> float:
    """How many versions the oldest trained episode's policy lags ``version`` by (0 for
    rollouts sampled from the policy itself, which record no version)."""
    lags = [
        version - t.policy_version
        for t, kept in zip(rollout.trajectories, kept_GN.flatten().tolist(), strict=True)
        if kept and t.policy_version is not None
    ]
    return float(max(lags, default=0))


def _collect(
    run: GRPORun, settings: RunSettings, seed: int, step_index: int
) -> tuple[RolloutBatch, torch.Tensor, float, StateValues | None]:
    """The batch of step ``step_index`` (0-based): played now with the current policy, or
    (servers) the round played ahead for it. Returns it, its rewards ``[G, N]``, the
    seconds spent generating its episodes (with servers: waiting for the round), and with
    ``credit: turn_mc`` the values of its states (continuations branched from checkpoints
    taken while it played)."""
    if run.server is not None:
        played, waited = run.server.next_round(step_index)
        rewards_GN = group_rewards(
            [t.reward for t in played.batch.trajectories], settings.group_size
        )
        if played.values is not None:
            _warn_refused(played.values, run.credit_refusals)
        return played.batch, rewards_GN, waited, played.values
    run.sampler.params = dataclasses.replace(run.sampler.params, seed=seed)
    run.sampler.seconds, run.sampler.calls = 0.0, 0
    run.policy.eval()
    checkpoints = None
    if settings.continuations is not None:
        if run.checkpoints is None:  # one for the run: ProcessFork's zygote is started once
            run.checkpoints = collector_checkpoints(run.collector, settings.continuations)
        checkpoints = run.checkpoints
    values = None
    with torch.no_grad():
        try:
            rollout = run.collector.collect(
                run.sampler,
                dynamic_sampling=settings.dynamic_sampling,
                observe=checkpoints,
                turn_signal=turn_signal(settings),
            )
            gen_time = run.sampler.seconds
            if checkpoints is not None:
                values = estimate_values(
                    checkpoints,
                    rollout.trajectories,
                    run.sampler,
                    keep_branches=settings.credit == "tree",
                )
                _warn_refused(values, run.credit_refusals)
        finally:
            if checkpoints is not None:
                checkpoints.release()
        run.sampler.drain()
        run.sampler.release()
    if run.engine is not None:  # learning has the device (sleep_between_steps)
        run.engine.sleep()
    rewards_GN = group_rewards([t.reward for t in rollout.trajectories], settings.group_size)
    return rollout, rewards_GN, gen_time, values


def _warn_refused(values: StateValues, shown: dict[str, str]) -> None:
    """Say once a run per kind (``shown``: the reasons said, by kind) why episodes could not
    be branched (they keep their episode advantage; ``credit_fallback_episodes`` counts them
    each step)."""
    for reason in values.refused.values():
        kind = reason.split(":", 1)[0]
        if kind not in shown:
            shown[kind] = reason
            logger.warning(
                "credit: turn_mc cannot branch an episode (%s); it keeps its episode "
                "advantage, counted in credit_fallback_episodes",
                reason,
            )


def _sampled_tokens(trajectory: Trajectory) -> int:
    """Tokens the policy sampled in ``trajectory``'s episode."""
    return sum(sum(sample.action_mask) for sample in trajectory.episode.samples)


def _reduce(accelerator: Any, values: dict[str, float], reduction: str) -> dict[str, float]:
    """Reduce each metric over processes (``"mean"`` or ``"sum"``; identity on one process)."""
    if accelerator.num_processes == 1:
        return {key: float(value) for key, value in values.items()}
    tensor = torch.tensor([float(v) for v in values.values()], device=accelerator.device)
    reduced = accelerator.reduce(tensor, reduction=reduction).tolist()
    return dict(zip(values, reduced, strict=True))
