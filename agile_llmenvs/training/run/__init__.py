"""The run and its folder: its settings (:class:`RunSettings`, read once from the manifest),
where it writes and whether it may, the record every loop keeps (:class:`RunBook`), its
checkpoints, metrics, experiment trackers, logged rollouts, progress line, stop signals and
env failures, and the :class:`TrainResult` it returns.

The names of the files a run writes are :mod:`agile_llmenvs._run_files`.
"""

from __future__ import annotations

from agile_llmenvs.training.run.book import RankState, RunBook, in_run_folder
from agile_llmenvs.training.run.checkpoint import (
    disk_full_error,
    load_checkpoint,
    save_checkpoint,
)
from agile_llmenvs.training.run.env_failures import EnvFailures, failure_kind
from agile_llmenvs.training.run.folder import (
    RESUMABLE_CHANGES,
    RunFolderLock,
    RunPlan,
    manifest_differences,
    plan_run,
    start_run,
)
from agile_llmenvs.training.run.interrupt import StopRequest
from agile_llmenvs.training.run.metrics import (
    MetricsWriter,
    TailMean,
    plot_metrics,
    read_metrics,
    tail_mean,
)
from agile_llmenvs.training.run.progress import PROGRESS_INTERVAL_S, Progress, quiet_libraries
from agile_llmenvs.training.run.result import TrainResult
from agile_llmenvs.training.run.rollout_log import (
    ENV,
    PROMPT,
    SAMPLED,
    RolloutLog,
    episode_record,
    provenance,
)
from agile_llmenvs.training.run.settings import (
    FailureLimits,
    GenerationSettings,
    HeldOutSettings,
    LoggingSettings,
    RunSettings,
    UpdateSettings,
)
from agile_llmenvs.training.run.trackers import (
    PROJECT,
    TRACKERS,
    TRL_NAMES,
    Trackers,
    open_trackers,
    tensorboard_setting,
)

__all__ = [
    "ENV",
    "PROGRESS_INTERVAL_S",
    "PROJECT",
    "PROMPT",
    "RESUMABLE_CHANGES",
    "SAMPLED",
    "TRACKERS",
    "TRL_NAMES",
    "EnvFailures",
    "FailureLimits",
    "GenerationSettings",
    "HeldOutSettings",
    "LoggingSettings",
    "MetricsWriter",
    "Progress",
    "RankState",
    "RolloutLog",
    "RunBook",
    "RunFolderLock",
    "RunPlan",
    "RunSettings",
    "StopRequest",
    "TailMean",
    "Trackers",
    "TrainResult",
    "UpdateSettings",
    "disk_full_error",
    "episode_record",
    "failure_kind",
    "in_run_folder",
    "load_checkpoint",
    "manifest_differences",
    "open_trackers",
    "plan_run",
    "plot_metrics",
    "provenance",
    "quiet_libraries",
    "read_metrics",
    "save_checkpoint",
    "start_run",
    "tail_mean",
    "tensorboard_setting",
]
