"""The text-env runtime: the TextEnv contract, OpenEnv transport, rollouts and dataset envs."""

from __future__ import annotations

from agile_llmenvs.llm_envs.contract import (
    SupportsDatasetSize,
    SupportsMaxTurns,
    SupportsSnapshot,
    SupportsTools,
    TextEnv,
)
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
    "EnvReply",
    "InProcessEnvClient",
    "OpenEnvServer",
    "OpenEnvWrapper",
    "RemoteEnvClient",
    "SupportsDatasetSize",
    "SupportsMaxTurns",
    "SupportsSnapshot",
    "SupportsTools",
    "TextAction",
    "TextEnv",
    "TextObservation",
    "resolve_env",
    "spec_to_factory",
]
