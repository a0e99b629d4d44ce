"""Batched evaluation: lock-step trajectory runners, multi-environment interleaving, results.

:class:`TrajectoryRunner` advances every live trajectory one step per backend call;
:func:`run_multi_evaluation` shares that loop across environments;
:class:`SegmentedTrajectoryRunner` does it segment by segment with a continuation strategy;
:class:`ImageChatBackend` shows a vision-language model the images an env sends.
"""

from __future__ import annotations

from agile_llmenvs.evaluation.images import ImageChatBackend
from agile_llmenvs.evaluation.multi import MultiEvalEntry, run_evaluation, run_multi_evaluation
from agile_llmenvs.evaluation.results import BatchResult, StopReason, Trajectory, Turn
from agile_llmenvs.evaluation.runner import (
    Progress,
    ProgressCallback,
    RunnerConfig,
    StepCallback,
    TrajectoryRunner,
)
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
