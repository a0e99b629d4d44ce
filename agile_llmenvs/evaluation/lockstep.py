"""The lock-step loop of evaluation, and the pieces every runner drives it with.

:func:`run_lockstep` makes one backend call per step for every live :class:`Rollout`; each
rollout is built and stepped by its own runner (:class:`LockstepRunner`, which
:class:`~agile_llmenvs.evaluation.runner.TrajectoryRunner` is), so rollouts of several
environments share one loop. :class:`ProgressCounter` counts what finished across chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

from agile_llmenvs.backends.types import Backend, Completion, Message, SamplingParams
from agile_llmenvs.core.types import Action, Environment, State
from agile_llmenvs.errors import BackendError, EvaluationError
from agile_llmenvs.evaluation.results import BatchResult, StopReason, Turn

__all__ = [
    "LockstepRunner",
    "Progress",
    "ProgressCallback",
    "ProgressCounter",
    "Rollout",
    "StepCallback",
    "chunked",
    "for_each",
    "run_lockstep",
]

ProgressCallback = Callable[[int, int], None]
"""Called as ``callback(completed, total)`` each time a trajectory finishes; ``completed``
counts across every chunk of a call (global offsets), ``total`` is the call's task count."""


@dataclass(frozen=True)
class Progress:
    """Where a run stands: reported when it starts and after every lock-step round.

    Attributes:
        steps: Env steps taken so far (one per completion that stepped its episode).
        max_steps: The most steps the run can take: those taken plus the remaining step
            budget of every unfinished trajectory (it shrinks as trajectories end early).
        tokens: Tokens generated so far (counted by local backends; API backends add 0).
        completed: Trajectories finished.
        total: Trajectories in the run.
    """

    steps: int
    max_steps: int
    tokens: int
    completed: int
    total: int


StepCallback = Callable[[Progress], None]
"""Called as ``callback(progress)`` when a run starts and after every lock-step round."""


@dataclass
class Rollout:
    """One trajectory in flight: its runner, its current state, and what happened so far.

    ``env`` is the instance the rollout steps (the runner's environment unless the
    multi-instance path gave it one of its own); ``base_steps`` counts the steps taken before
    the rollout began (a rollout from a mid-episode state), which the step budget includes;
    ``images`` maps a message of the state's conversation (by index) to the images it shows.
    """

    runner: LockstepRunner
    task_index: int
    state: State | None = None
    turns: list[Turn] = field(default_factory=list)
    last_info: dict[str, Any] = field(default_factory=dict)
    stop_reason: StopReason | None = None
    error: str | None = None
    env: Environment | None = None
    base_steps: int = 0
    images: dict[int, tuple[Any, ...]] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        """Whether the trajectory has ended."""
        return self.stop_reason is not None

    @property
    def environment(self) -> Environment:
        """The environment this rollout steps."""
        return self.env if self.env is not None else self.runner.environment


class LockstepRunner(Protocol):
    """What the lock-step loop (and the runs from saved states) ask of a rollout's runner."""

    environment: Environment
    backend: Backend
    sampling_params: SamplingParams
    env_factory: Callable[[], Environment] | None
    restore_fn: Callable[[Environment, State], Any] | None

    @property
    def max_steps(self) -> int:
        """The step budget of each trajectory."""
        ...

    def messages(self, rollout: Rollout) -> list[Message]:
        """The conversation to generate ``rollout``'s next action from."""
        ...

    def advance(self, rollout: Rollout, completion: Completion) -> None:
        """Step ``rollout``'s episode with ``completion``."""
        ...

    def act(self, rollout: Rollout, action: Action) -> None:
        """Step ``rollout``'s episode with ``action``."""
        ...

    def collect(self, rollouts: Sequence[Rollout]) -> BatchResult:
        """The finished ``rollouts`` as a :class:`BatchResult`."""
        ...


_ERRORS = (StopReason.BACKEND_ERROR, StopReason.ENV_ERROR)


class ProgressCounter:
    """Counts finished trajectories, steps and tokens across chunks, and reports them.

    Args:
        total: Trajectories in the run.
        callback: ``callback(completed, total)`` after each trajectory ends.
        on_step: ``on_step(progress)`` when the run starts and after every round.
        max_steps: The run's whole step budget (every trajectory's, before any ran).
    """

    def __init__(
        self,
        total: int,
        callback: ProgressCallback | None,
        *,
        on_step: StepCallback | None = None,
        max_steps: int = 0,
    ) -> None:
        self.total, self.completed, self.callback = total, 0, callback
        self.on_step = on_step
        self.steps, self.tokens, self.max_steps = 0, 0, max_steps

    def finished(self, rollout: Rollout) -> None:
        """Count ``rollout`` as done; its unused step budget leaves the total."""
        self.completed += 1
        budget = rollout.runner.max_steps - rollout.base_steps
        self.max_steps -= max(0, budget - len(rollout.turns))
        if self.callback is not None:
            self.callback(self.completed, self.total)

    def stepped(self, pairs: Sequence[tuple[Rollout, Completion]]) -> None:
        """Count one round: the steps it took and the tokens it generated."""
        self.steps += sum(1 for rollout, _ in pairs if rollout.stop_reason not in _ERRORS)
        self.tokens += sum(
            len(c.generation.token_ids) for _, c in pairs if c.generation is not None
        )

    def report(self) -> None:
        """Tell ``on_step`` where the run stands."""
        if self.on_step is not None:
            progress = Progress(self.steps, self.max_steps, self.tokens, self.completed, self.total)
            self.on_step(progress)


def chunked(items: list[Any], batch_size: int | None) -> list[list[Any]]:
    """``items`` in consecutive chunks of ``batch_size`` (one chunk when ``None``)."""
    if batch_size is None:
        return [items] if items else []
    if batch_size < 1:
        raise EvaluationError(f"batch_size must be >= 1 or None, got {batch_size}")
    return [items[i : i + batch_size] for i in range(0, len(items), batch_size)]


def _advance(rollout: Rollout, completion: Completion) -> None:
    rollout.runner.advance(rollout, completion)


def for_each(
    call: Callable[..., Any], pairs: Sequence[tuple[Any, ...]], executor: Executor | None
) -> None:
    """``call(*pair)`` for every pair: in ``executor``'s threads when given, else in order."""
    if executor is None:
        for pair in pairs:
            call(*pair)
    else:
        list(executor.map(lambda pair: call(*pair), pairs))


def run_lockstep(
    rollouts: Sequence[Rollout],
    backend: Backend,
    params: SamplingParams,
    progress: ProgressCounter | None = None,
    executor: Executor | None = None,
) -> None:
    """Drive ``rollouts`` to their ends, one backend call per step for all live ones.

    Each rollout is built and stepped by its own runner, so rollouts of several
    environments can share the loop (all must offer the same tools). With ``executor``, the
    env steps of one round run in its threads (rollouts on independent env instances).
    """
    for rollout in rollouts:
        if rollout.finished and progress is not None:  # its reset failed
            progress.finished(rollout)
    live = [r for r in rollouts if not r.finished]
    tools = live[0].runner.environment.spec.tools if live else ()
    while live:
        batch = [r.runner.messages(r) for r in live]
        if tools:
            completions = backend.generate_with_tools_batch(batch, tools, params)
        else:
            completions = backend.generate_chat_batch(batch, params)
        if len(completions) != len(batch):
            raise BackendError(
                f"{type(backend).__name__} returned {len(completions)} completions for a batch "
                f"of {len(batch)}; a backend must return one per conversation"
            )
        pairs = list(zip(live, completions, strict=True))
        for_each(_advance, pairs, executor)
        if progress is not None:
            progress.stepped(pairs)
            for rollout in live:
                if rollout.finished:
                    progress.finished(rollout)
            progress.report()
        live = [r for r in live if not r.finished]
