"""What a terminal environment runs its episodes in: a task source that opens sandboxes.

:class:`~agile_llmenvs.adapters.terminal.TerminalEnvironment` owns the episode logic (actions,
budgets, the replay history, stale states); a :class:`TaskSource` owns where commands run.
The local one (:class:`~agile_llmenvs.adapters.terminal.TaskFolder`) opens a shell in a
temporary directory; the Harbor one opens a container. One environment class, one restore.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from agile_llmenvs.adapters.terminal.shell import CommandResult

__all__ = ["Sandbox", "TaskSource", "Verdict"]


@dataclass(frozen=True)
class Verdict:
    """A verifier's judgement of an episode.

    Attributes:
        reward: The episode's reward.
        output: What the verifier printed (for logs and ``info``).
        exit_code: The verifier's exit status; ``None`` when it timed out.
    """

    reward: float
    output: str = ""
    exit_code: int | None = 0


class Sandbox(Protocol):
    """One episode's place to run commands: a shell, a container."""

    def run(self, command: str, timeout_s: float) -> CommandResult:
        """Run one complete command, waiting at most ``timeout_s`` seconds."""
        ...

    def verify(self) -> Verdict:
        """Run the task's verifier on what the episode left behind."""
        ...

    def close(self) -> None:
        """Stop everything the sandbox started and delete what it made."""
        ...


class TaskSource(Protocol):
    """An ordered list of tasks, each able to open fresh sandboxes."""

    @property
    def task_names(self) -> tuple[str, ...]:
        """The tasks' names; a task's position here is its ``task_index``."""
        ...

    def instruction(self, task_index: int) -> str:
        """What the agent is asked to do in task ``task_index``."""
        ...

    def open(self, task_index: int, seed: int | None) -> Sandbox:
        """A fresh sandbox for task ``task_index``, set up and ready for commands."""
        ...
