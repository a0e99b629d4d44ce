"""Evaluation entry points: one environment, or several interleaved in one lock-step loop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from agile_llmenvs.backends.types import Backend, SamplingParams
from agile_llmenvs.core.types import Environment
from agile_llmenvs.errors import EvaluationError
from agile_llmenvs.evaluation.lockstep import (
    ProgressCallback,
    ProgressCounter,
    Rollout,
    StepCallback,
    chunked,
    run_lockstep,
)
from agile_llmenvs.evaluation.results import BatchResult
from agile_llmenvs.evaluation.runner import RunnerConfig, TrajectoryRunner

__all__ = ["MultiEvalEntry", "run_evaluation", "run_multi_evaluation"]


@dataclass(frozen=True)
class MultiEvalEntry:
    """One environment's part of a multi-environment evaluation.

    Attributes:
        runner: The environment's runner (a plain :class:`TrajectoryRunner`).
        task_indices: The tasks to run in it.
    """

    runner: TrajectoryRunner
    task_indices: Sequence[int]


def run_evaluation(
    environment: Environment,
    backend: Backend,
    sampling_params: SamplingParams | None = None,
    *,
    num_tasks: int | None = None,
    system_prompt: str | None = None,
    batch_size: int | None = None,
    config: RunnerConfig | None = None,
    progress_callback: ProgressCallback | None = None,
) -> BatchResult:
    """Evaluate ``backend`` on the first ``num_tasks`` tasks of ``environment``.

    Args:
        environment: The environment.
        backend: The model.
        sampling_params: How to sample; defaults to ``SamplingParams()``.
        num_tasks: How many tasks (rows 0 .. n-1); defaults to the env's ``dataset_size``.
        system_prompt: A system message before every conversation (overrides ``config``'s).
        batch_size: Trajectories per lock-step batch; ``None`` runs all together.
        config: Further runner settings.
        progress_callback: ``callback(completed, total)`` after each trajectory ends.

    Returns:
        The trajectories of tasks ``0 .. num_tasks - 1``, in order.

    Raises:
        EvaluationError: ``num_tasks`` is not given and the env has no ``dataset_size``.
    """
    count = num_tasks if num_tasks is not None else environment.spec.dataset_size
    if count is None:
        raise EvaluationError(
            f"environment {environment.spec.name!r} does not say how many tasks it has: "
            "pass num_tasks=..."
        )
    config = config or RunnerConfig()
    if system_prompt is not None:
        config = replace(config, system_prompt=system_prompt)
    runner = TrajectoryRunner(environment, backend, sampling_params, config=config)
    return runner.run_batch(range(count), batch_size, progress_callback)


def _check_entries(entries: Sequence[MultiEvalEntry]) -> None:
    if not entries:
        raise EvaluationError("run_multi_evaluation needs at least one entry")
    first = entries[0].runner
    for index, entry in enumerate(entries):
        runner = entry.runner
        if type(runner) is not TrajectoryRunner:
            raise EvaluationError(
                f"entries[{index}] has a {type(runner).__name__}; only TrajectoryRunner "
                "entries can be interleaved (segmented and tool runners step differently)"
            )
        if runner.backend is not first.backend:
            raise EvaluationError(
                f"entries[{index}] uses a different backend object from entries[0]; all "
                "entries must share one backend so that each step is one generate call"
            )
        if runner.sampling_params != first.sampling_params:
            raise EvaluationError(
                f"entries[{index}] samples with {runner.sampling_params}, entries[0] with "
                f"{first.sampling_params}; all entries must share sampling params"
            )
        if runner.environment.spec.tools != first.environment.spec.tools:
            raise EvaluationError(
                f"entries[{index}] offers different tools from entries[0]; all entries must "
                "offer the same tools to share generate calls"
            )


def run_multi_evaluation(
    entries: Sequence[MultiEvalEntry],
    batch_size: int | None = None,
    progress_callback: ProgressCallback | None = None,
    *,
    on_step: StepCallback | None = None,
) -> list[BatchResult]:
    """Evaluate several environments in one lock-step loop.

    All trajectories of all entries are reset together (``batch_size`` at a time, across
    entries, in entry order), and each step makes one backend call for every live trajectory
    of every environment; each trajectory is built and stepped by its own entry's runner.

    Args:
        entries: The environments (their runners) and their tasks.
        batch_size: Trajectories per lock-step batch, across entries; ``None`` runs all.
        progress_callback: ``callback(completed, total)`` after each trajectory ends.
        on_step: ``on_step(progress)`` with the steps, tokens and trajectories done so far,
            once before the first step and after every lock-step round (a progress bar's
            hook: its ETA can come from steps, long before whole trajectories finish).

    Returns:
        One :class:`BatchResult` per entry, in entry order, its trajectories in task order.

    Raises:
        EvaluationError: (a ``ValueError``) ``entries`` is empty, an entry's runner is not a
            plain ``TrajectoryRunner``, entries differ in backend, sampling params or tools,
            or ``batch_size`` is below 1.
    """
    _check_entries(entries)
    first = entries[0].runner
    work = [(n, i) for n, entry in enumerate(entries) for i in entry.task_indices]
    chunks = chunked(work, batch_size)
    budget = sum(entries[n].runner.max_steps for n, _ in work)
    progress = ProgressCounter(len(work), progress_callback, on_step=on_step, max_steps=budget)
    progress.report()
    finished: list[list[Rollout]] = [[] for _ in entries]
    for chunk in chunks:
        rollouts = [entries[n].runner.start(i) for n, i in chunk]
        run_lockstep(rollouts, first.backend, first.sampling_params, progress)
        for (n, _), rollout in zip(chunk, rollouts, strict=True):
            finished[n].append(rollout)
    return [entry.runner.collect(done) for entry, done in zip(entries, finished, strict=True)]
