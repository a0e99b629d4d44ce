"""Segment-level lock-step generation: each turn's response is built a segment at a time.

Every round, the continuation strategy produces one segment for each live trajectory with
:meth:`ContinuationStrategy.generate_segment_batch` (one backend call for all of those that
need the model). A trajectory whose next segment is forced (:class:`ForceAction`) skips the
backend. A trajectory whose strategy signals :data:`COMPLETE` gets its final part from an
individual ``generate_chat`` call, and its env is stepped with the whole response.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Protocol

from agile_llmenvs.backends.types import Backend, Completion, Message, SamplingParams
from agile_llmenvs.core.types import Environment
from agile_llmenvs.evaluation.lockstep import ProgressCallback, ProgressCounter, Rollout, chunked
from agile_llmenvs.evaluation.results import BatchResult
from agile_llmenvs.evaluation.runner import RunnerConfig, TrajectoryRunner

__all__ = [
    "COMPLETE",
    "ContinuationStrategy",
    "ForceAction",
    "Segment",
    "SegmentBudget",
    "SegmentContext",
    "SegmentSignal",
    "SegmentedTrajectoryRunner",
]

#: A safety net against strategies that never complete a turn.
MAX_SEGMENTS_PER_TURN = 256


class SegmentSignal(Enum):
    """Signals a strategy gives instead of a segment."""

    COMPLETE = "complete"
    """The turn's response is finished: generate its final part and step the env."""


COMPLETE = SegmentSignal.COMPLETE


@dataclass(frozen=True)
class ForceAction:
    """A segment inserted as is, without calling the backend."""

    text: str


Segment = str | ForceAction | SegmentSignal
"""What a strategy gives per trajectory: generated text, a forced segment, or a signal."""


@dataclass(frozen=True)
class SegmentContext:
    """Where one trajectory's current turn stands.

    Attributes:
        task_index: The trajectory's task.
        messages: The conversation the turn answers (system prompt included).
        segments: The segments of the turn so far, in order.
    """

    task_index: int
    messages: tuple[Message, ...]
    segments: tuple[str, ...] = ()

    @property
    def partial(self) -> str:
        """The turn's response so far."""
        return "".join(self.segments)


class ContinuationStrategy(Protocol):
    """Decides and generates the next segment of every live trajectory."""

    def generate_segment_batch(
        self, backend: Backend, contexts: Sequence[SegmentContext], params: SamplingParams
    ) -> list[Segment]:
        """One segment (or signal) per context, in order, calling the backend at most once."""
        ...

    def final_messages(self, context: SegmentContext) -> list[Message]:
        """The conversation whose completion ends a turn signalled :data:`COMPLETE`."""
        ...


def _continuation(context: SegmentContext, prompt: str) -> list[Message]:
    messages = list(context.messages)
    if context.segments:
        messages += [
            {"role": "assistant", "content": context.partial},
            {"role": "user", "content": prompt},
        ]
    return messages


@dataclass(frozen=True)
class SegmentBudget:
    """Segments of at most ``segment_tokens`` tokens, at most ``max_segments`` per turn.

    A turn completes when its ``max_segments`` are spent (a segment the model ended early
    does not end the turn). ``force`` may return a segment to insert instead of generating
    one (``None`` to generate).

    Attributes:
        segment_tokens: Token budget of each generated segment.
        max_segments: Segments per turn before it completes.
        force: ``force(context) -> str | None``: a forced segment for that context.
        continue_prompt: The user turn asking the model to go on with its response.
        final_prompt: The user turn asking for the final part of a completed response.
    """

    segment_tokens: int = 64
    max_segments: int = 4
    force: Callable[[SegmentContext], str | None] | None = None
    continue_prompt: str = "Continue."
    final_prompt: str = "Now give your final answer."

    def decide(self, context: SegmentContext) -> Segment | None:
        """The segment or signal for ``context`` that needs no model (``None``: generate)."""
        if len(context.segments) >= self.max_segments:
            return COMPLETE
        forced = self.force(context) if self.force is not None else None
        return ForceAction(forced) if forced is not None else None

    def generate_segment_batch(
        self, backend: Backend, contexts: Sequence[SegmentContext], params: SamplingParams
    ) -> list[Segment]:
        """Forced segments and signals first; one backend call for all the rest."""
        outcomes = [self.decide(c) for c in contexts]
        todo = [n for n, outcome in enumerate(outcomes) if outcome is None]
        if todo:
            segment_params = replace(params, max_tokens=min(params.max_tokens, self.segment_tokens))
            batch = [_continuation(contexts[n], self.continue_prompt) for n in todo]
            completions = backend.generate_chat_batch(batch, segment_params)
            for n, completion in zip(todo, completions, strict=True):
                # A failed segment completes the turn: the final call retries, and if that
                # fails too the trajectory ends with a backend error.
                outcomes[n] = COMPLETE if completion.finish_reason == "error" else completion.text
        return [outcome if outcome is not None else COMPLETE for outcome in outcomes]

    def final_messages(self, context: SegmentContext) -> list[Message]:
        """The conversation so far, then :attr:`final_prompt`."""
        return (
            _continuation(context, self.final_prompt)
            if context.segments
            else list(context.messages)
        )


class SegmentedTrajectoryRunner(TrajectoryRunner):
    """Runs trajectories in lock-step at the level of response segments.

    Args:
        environment: The environment (several episodes at once, as for TrajectoryRunner).
        backend: Generates segments and final parts.
        sampling_params: How to sample; defaults to ``SamplingParams()``.
        strategy: Decides and generates each round's segments.
        config: System prompt, step budget, seeding and the success threshold.
    """

    def __init__(
        self,
        environment: Environment,
        backend: Backend,
        sampling_params: SamplingParams | None = None,
        *,
        strategy: ContinuationStrategy,
        config: RunnerConfig | None = None,
    ) -> None:
        super().__init__(environment, backend, sampling_params, config=config)
        self.strategy = strategy

    def run_batch(
        self,
        task_indices: Sequence[int],
        batch_size: int | None = None,
        progress_callback: ProgressCallback | None = None,
    ) -> BatchResult:
        """Run one trajectory per task, segment by segment, in lock-step.

        Args:
            task_indices: The tasks to run, in the order results come back.
            batch_size: Run at most this many trajectories at once; ``None`` runs all.
            progress_callback: ``callback(completed, total)`` after each trajectory ends.

        Returns:
            The trajectories, in the order of ``task_indices``.
        """
        indices = list(task_indices)
        progress = ProgressCounter(len(indices), progress_callback)
        results = []
        for chunk in chunked(indices, batch_size):
            rollouts = [self.start(i) for i in chunk]
            self._run_segments(rollouts, progress)
            results.append(self.collect(rollouts))
        return BatchResult.concat(results, self.environment.spec.name)

    def _run_segments(self, rollouts: list[Rollout], progress: ProgressCounter) -> None:
        for rollout in rollouts:
            if rollout.finished:
                progress.finished(rollout)
        segments: dict[int, list[str]] = {id(r): [] for r in rollouts}
        live = [r for r in rollouts if not r.finished]
        while live:
            contexts = [
                SegmentContext(r.task_index, tuple(self.messages(r)), tuple(segments[id(r)]))
                for r in live
            ]
            outcomes = self.strategy.generate_segment_batch(
                self.backend, contexts, self.sampling_params
            )
            for rollout, context, outcome in zip(live, contexts, outcomes, strict=True):
                turn = segments[id(rollout)]
                if outcome is COMPLETE or len(turn) >= MAX_SEGMENTS_PER_TURN:
                    self.advance(rollout, self._complete(context))
                    turn.clear()
                    if rollout.finished:
                        progress.finished(rollout)
                else:
                    turn.append(outcome.text if isinstance(outcome, ForceAction) else str(outcome))
            live = [r for r in live if not r.finished]

    def _complete(self, context: SegmentContext) -> Completion:
        final = self.backend.generate_chat(
            self.strategy.final_messages(context), self.sampling_params
        )
        if final.finish_reason == "error":
            return final
        return replace(final, text=context.partial + final.text, generation=None)
