"""A terminal environment for agent tasks that runs without Docker.

Each episode is a persistent ``bash`` in its own temporary working directory, jailed with
bubblewrap (its own PID, mount and network namespaces, an unprivileged uid, rlimits; see
:mod:`~agile_llmenvs.adapters.terminal.jail`); tasks come from
a folder (``instruction.md`` + ``verify.sh``, optionally ``setup.sh``); the policy sends one
shell command per step and ``submit`` when done; a per-episode time budget bounds it. States
are not pure, so a state is restored on a fresh instance by replaying its commands
(:func:`terminal_restore`), and :func:`validate_replay_consistency` tells whether that replay
is faithful for a trajectory. See docs/terminal.md.
"""

from __future__ import annotations

from agile_llmenvs.adapters.terminal.actions import ParsedAction, parse_action
from agile_llmenvs.adapters.terminal.env import (
    CommandHistory,
    TerminalConfig,
    TerminalEnvironment,
    TimeBudget,
)
from agile_llmenvs.adapters.terminal.jail import SandboxLimits
from agile_llmenvs.adapters.terminal.replay import (
    DEFAULT_PROBES,
    SupportsReplay,
    restore_by_replay,
    terminal_restore,
    validate_replay_consistency,
)
from agile_llmenvs.adapters.terminal.sandbox import Sandbox, TaskSource, Verdict
from agile_llmenvs.adapters.terminal.shell import CommandResult, ShellSession, is_incomplete
from agile_llmenvs.adapters.terminal.tasks import LocalSandbox, TaskFolder, TerminalTask

__all__ = [
    "DEFAULT_PROBES",
    "CommandHistory",
    "CommandResult",
    "LocalSandbox",
    "ParsedAction",
    "Sandbox",
    "SandboxLimits",
    "ShellSession",
    "SupportsReplay",
    "TaskFolder",
    "TaskSource",
    "TerminalConfig",
    "TerminalEnvironment",
    "TerminalTask",
    "TimeBudget",
    "Verdict",
    "is_incomplete",
    "parse_action",
    "restore_by_replay",
    "terminal_restore",
    "validate_replay_consistency",
]
