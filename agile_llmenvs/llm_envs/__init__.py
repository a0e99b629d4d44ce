"""The text-env runtime: the TextEnv contract, OpenEnv transport, rollouts and dataset envs."""

from __future__ import annotations

from agile_llmenvs.llm_envs.contract import (
    SupportsDatasetSize,
    SupportsMaxTurns,
    SupportsSnapshot,
    SupportsTools,
    TextEnv,
)

__all__ = [
    "SupportsDatasetSize",
    "SupportsMaxTurns",
    "SupportsSnapshot",
    "SupportsTools",
    "TextEnv",
]
