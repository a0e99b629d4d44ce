"""Branching: independent copies of an environment from mid-episode checkpoints.

:class:`BranchManager` checkpoints states by name and hands out independent ``(env, state)``
branches of them, for Monte-Carlo Q-values, action exploration and tree search. Three
strategies make the copies: :class:`DirectStrategy` (a pure-step env is its own copy),
:class:`ProcessForkStrategy` (a copy-on-write fork of a process holding the env) and
:class:`ActionReplayStrategy` (a fresh env, reset and replayed).
"""

from __future__ import annotations

from agile_llmenvs.branching.checkpoint import BranchStrategy, Checkpoint, HeldCheckpoint
from agile_llmenvs.branching.direct import DirectStrategy
from agile_llmenvs.branching.fork import ForkedEnvironment, ProcessForkStrategy
from agile_llmenvs.branching.manager import BranchManager, StrategyName, resolve_strategy
from agile_llmenvs.branching.replay import ActionReplayStrategy

__all__ = [
    "ActionReplayStrategy",
    "BranchManager",
    "BranchStrategy",
    "Checkpoint",
    "DirectStrategy",
    "ForkedEnvironment",
    "HeldCheckpoint",
    "ProcessForkStrategy",
    "StrategyName",
    "resolve_strategy",
]
