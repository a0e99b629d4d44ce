"""Rollouts from saved states: the single-instance path and the multi-instance path.

A pure-step env continues any state on the runner's own environment. A non-pure env (a
shell, a container, a simulator behind the state) cannot step a state twice, so for
Monte-Carlo rollouts each one gets a fresh instance from ``env_factory``, brought to its state
by ``restore_fn``. Restores and env steps run in threads (they are I/O-bound: subprocesses,
containers, sockets) while generation stays one batched backend call per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from agile_llmenvs.core.types import Action, Environment, State
from agile_llmenvs.errors import EvaluationError
from agile_llmenvs.evaluation.lockstep import (
    LockstepRunner,
    ProgressCallback,
    ProgressCounter,
    Rollout,
    chunked,
    for_each,
    run_lockstep,
)
from agile_llmenvs.evaluation.results import BatchResult, StopReason

__all__ = ["run_from_states"]


def run_from_states(
    runner: LockstepRunner,
    states: Sequence[State],
    actions: Sequence[Action] | None,
    batch_size: int | None,
    progress_callback: ProgressCallback | None,
) -> BatchResult:
    """Continue one rollout from each state (first step forced when ``actions`` is given)."""
    env = runner.environment
    multi = not env.spec.pure_step and runner.env_factory is not None
    if multi and runner.restore_fn is None:
        raise EvaluationError(
            "env_factory is set but restore_fn is not: each fresh instance must be restored "
            "to its state; pass restore_fn (agile_llmenvs.core.replay.replay_restore for a "
            "deterministic env, terminal_restore for the terminal env)"
        )
    if not env.spec.pure_step and not multi:
        _check_distinct_episodes(env, states)
    indices = list(range(len(states)))
    progress = ProgressCounter(len(indices), progress_callback)
    results = []
    for chunk in chunked(indices, batch_size):
        chunk_states = [states[i] for i in chunk]
        chunk_actions = None if actions is None else [actions[i] for i in chunk]
        if multi:
            results.append(_run_instances(runner, chunk_states, chunk_actions, progress))
        else:
            rollouts = [_rollout(runner, state) for state in chunk_states]
            _force(runner, rollouts, chunk_actions, None)
            run_lockstep(rollouts, runner.backend, runner.sampling_params, progress)
            results.append(runner.collect(rollouts))
    return BatchResult.concat(results, env.spec.name)


def _run_instances(
    runner: LockstepRunner,
    states: list[State],
    actions: list[Action] | None,
    progress: ProgressCounter,
) -> BatchResult:
    envs: list[Environment] = []
    try:
        result = _drive(runner, states, actions, progress, envs)
    except BaseException:
        _close_all(envs, quiet=True)
        raise
    _close_all(envs)
    return result


def _drive(
    runner: LockstepRunner,
    states: list[State],
    actions: list[Action] | None,
    progress: ProgressCounter,
    envs: list[Environment],
) -> BatchResult:
    """Make, restore and run one instance per state; ``envs`` collects what was made."""
    factory, restore = runner.env_factory, runner.restore_fn
    assert factory is not None
    assert restore is not None
    with ThreadPoolExecutor(max_workers=len(states)) as pool:
        made = [pool.submit(factory) for _ in states]
        rollouts = []
        for future, state in zip(made, states, strict=True):
            rollout = _rollout(runner, state)
            try:
                rollout.env = future.result()
                envs.append(rollout.env)
            except Exception as exc:
                _fail(rollout, f"env_factory failed: {type(exc).__name__}: {exc}")
            rollouts.append(rollout)
        restoring = [
            (r, pool.submit(restore, r.env, state))
            for r, state in zip(rollouts, states, strict=True)
            if r.env is not None and not r.finished
        ]
        for rollout, restored in restoring:
            try:
                rollout.state = restored.result()
            except Exception as exc:
                _fail(rollout, f"restore_fn failed: {type(exc).__name__}: {exc}")
        _force(runner, rollouts, actions, pool)
        run_lockstep(rollouts, runner.backend, runner.sampling_params, progress, pool)
        return runner.collect(rollouts)


def _rollout(runner: LockstepRunner, state: State) -> Rollout:
    task = state.task
    task_index = int(task.get("row_index", task.get("task_index", -1)))
    rollout = Rollout(runner, task_index, state=state, base_steps=state.step_count)
    if state.done:
        rollout.stop_reason = StopReason.TERMINATED
    elif state.step_count >= runner.max_steps:
        rollout.stop_reason = StopReason.MAX_STEPS
    return rollout


def _force(
    runner: LockstepRunner,
    rollouts: list[Rollout],
    actions: list[Action] | None,
    pool: ThreadPoolExecutor | None,
) -> None:
    """Take each live rollout's forced first action (the progress is counted by the loop)."""
    if actions is None:
        return
    pairs = [(r, a) for r, a in zip(rollouts, actions, strict=True) if not r.finished]
    for_each(runner.act, pairs, pool)


def _fail(rollout: Rollout, error: str) -> None:
    rollout.stop_reason, rollout.error = StopReason.ENV_ERROR, error


def _check_distinct_episodes(env: Environment, states: Sequence[State]) -> None:
    seen: set[int] = set()
    for state in states:
        if state.episode_id in seen:
            raise EvaluationError(
                f"{env.spec.name!r} is not pure-step, so each of its states can be continued "
                f"once; episode {state.episode_id} appears more than once. Give the runner "
                "env_factory and restore_fn to run many rollouts from one state"
            )
        seen.add(state.episode_id)


def _close_all(envs: list[Environment], *, quiet: bool = False) -> None:
    """Close every instance; the first close error is raised unless ``quiet``."""
    errors = []
    for env in envs:
        try:
            env.close()
        except Exception as exc:
            errors.append(exc)
    if errors and not quiet:
        raise errors[0]
