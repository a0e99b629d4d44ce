"""Batched evaluation: lock-step trajectory runners, multi-environment interleaving, results.

:class:`TrajectoryRunner` advances every live trajectory one step per backend call;
:func:`run_multi_evaluation` shares that loop across environments;
:class:`SegmentedTrajectoryRunner` does it segment by segment with a continuation strategy;
:class:`ImageChatBackend` shows a vision-language model the images an env sends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agile_llmenvs._lazy import lazy_attributes

if TYPE_CHECKING:
    from agile_llmenvs.evaluation.images import ImageChatBackend
    from agile_llmenvs.evaluation.lockstep import Progress, ProgressCallback, StepCallback
    from agile_llmenvs.evaluation.multi import MultiEvalEntry, run_evaluation, run_multi_evaluation
    from agile_llmenvs.evaluation.results import BatchResult, StopReason, Trajectory, Turn
    from agile_llmenvs.evaluation.runner import RunnerConfig, TrajectoryRunner
    from agile_llmenvs.evaluation.segmented import (
        COMPLETE,
        ContinuationStrategy,
        ForceAction,
        SegmentBudget,
        SegmentContext,
        SegmentedTrajectoryRunner,
        SegmentSignal,
    )

__all__ = [
    "COMPLETE",
    "BatchResult",
    "ContinuationStrategy",
    "ForceAction",
    "ImageChatBackend",
    "MultiEvalEntry",
    "Progress",
    "ProgressCallback",
    "RunnerConfig",
    "SegmentBudget",
    "SegmentContext",
    "SegmentSignal",
    "SegmentedTrajectoryRunner",
    "StepCallback",
    "StopReason",
    "Trajectory",
    "TrajectoryRunner",
    "Turn",
    "run_evaluation",
    "run_multi_evaluation",
]

__getattr__, __dir__ = lazy_attributes(
    __name__,
    globals(),
    {
        "BatchResult": "agile_llmenvs.evaluation.results",
        "COMPLETE": "agile_llmenvs.evaluation.segmented",
        "ContinuationStrategy": "agile_llmenvs.evaluation.segmented",
        "ForceAction": "agile_llmenvs.evaluation.segmented",
        "ImageChatBackend": "agile_llmenvs.evaluation.images",
        "MultiEvalEntry": "agile_llmenvs.evaluation.multi",
        "Progress": "agile_llmenvs.evaluation.lockstep",
        "ProgressCallback": "agile_llmenvs.evaluation.lockstep",
        "RunnerConfig": "agile_llmenvs.evaluation.runner",
        "SegmentBudget": "agile_llmenvs.evaluation.segmented",
        "SegmentContext": "agile_llmenvs.evaluation.segmented",
        "SegmentSignal": "agile_llmenvs.evaluation.segmented",
        "SegmentedTrajectoryRunner": "agile_llmenvs.evaluation.segmented",
        "StepCallback": "agile_llmenvs.evaluation.lockstep",
        "StopReason": "agile_llmenvs.evaluation.results",
        "Trajectory": "agile_llmenvs.evaluation.results",
        "TrajectoryRunner": "agile_llmenvs.evaluation.runner",
        "Turn": "agile_llmenvs.evaluation.results",
        "run_evaluation": "agile_llmenvs.evaluation.multi",
        "run_multi_evaluation": "agile_llmenvs.evaluation.multi",
    },
)
