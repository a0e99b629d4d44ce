"""The text-env runtime: the TextEnv contract, OpenEnv transport, rollouts and dataset envs."""

from __future__ import annotations

from agile_llmenvs.llm_envs.collector import EpisodeHandle, RolloutCollector
from agile_llmenvs.llm_envs.contract import (
    SupportsDatasetSize,
    SupportsMaxTurns,
    SupportsSnapshot,
    SupportsTools,
    TextEnv,
)
from agile_llmenvs.llm_envs.dataset_env import DatasetEnv, PreferenceBatch, SFTBatch
from agile_llmenvs.llm_envs.episode import EpisodeData, StopReason, TokenSample, TurnResult
from agile_llmenvs.llm_envs.framing import ChatTemplateError, apply_chat_template
from agile_llmenvs.llm_envs.harness import HarnessConfig, RolloutHarness
from agile_llmenvs.llm_envs.tasks import Task, TaskAssigner, TaskRowStats, TaskRowWeight
from agile_llmenvs.llm_envs.trajectory import RolloutBatch, Trajectory
from agile_llmenvs.transport import (
    EnvReply,
    InProcessEnvClient,
    OpenEnvServer,
    OpenEnvWrapper,
    RemoteEnvClient,
    TextAction,
    TextObservation,
)
from agile_llmenvs.transport.resolve import resolve_env, spec_to_factory

__all__ = [
    "ChatTemplateError",
    "DatasetEnv",
    "EnvReply",
    "EpisodeData",
    "EpisodeHandle",
    "HarnessConfig",
    "InProcessEnvClient",
    "OpenEnvServer",
    "OpenEnvWrapper",
    "PreferenceBatch",
    "RemoteEnvClient",
    "RolloutBatch",
    "RolloutCollector",
    "RolloutHarness",
    "SFTBatch",
    "StopReason",
    "SupportsDatasetSize",
    "SupportsMaxTurns",
    "SupportsSnapshot",
    "SupportsTools",
    "Task",
    "TaskAssigner",
    "TaskRowStats",
    "TaskRowWeight",
    "TextAction",
    "TextEnv",
    "TextObservation",
    "TokenSample",
    "Trajectory",
    "TurnResult",
    "apply_chat_template",
    "resolve_env",
    "spec_to_factory",
]
