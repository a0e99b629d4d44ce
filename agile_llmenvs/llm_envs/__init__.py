"""The text-env runtime: rollouts over the TextEnv contract, OpenEnv transport, dataset envs.

The contract (:class:`TextEnv`) and the episode records (:class:`EpisodeData`,
:class:`Trajectory`, ...) are the core vocabulary (:mod:`agile_llmenvs.core`), exported here
too.
"""

from __future__ import annotations

from agile_llmenvs.core import (
    EpisodeData,
    RolloutBatch,
    StopReason,
    SupportsDatasetSize,
    SupportsMaxTurns,
    SupportsSnapshot,
    SupportsTools,
    Task,
    TextEnv,
    TokenSample,
    Trajectory,
    TurnResult,
)
from agile_llmenvs.llm_envs.collector import EpisodeHandle, RolloutCollector
from agile_llmenvs.llm_envs.dataset_env import DatasetEnv, PreferenceBatch, SFTBatch
from agile_llmenvs.llm_envs.framing import ChatTemplateError, apply_chat_template
from agile_llmenvs.llm_envs.harness import HarnessConfig, RolloutHarness
from agile_llmenvs.llm_envs.slots import SlotPool
from agile_llmenvs.llm_envs.tasks import TaskAssigner, TaskRowStats, TaskRowWeight
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
    "SlotPool",
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
