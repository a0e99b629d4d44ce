"""The terminal environment: agent tasks driven one shell command per step.

Each episode runs in a sandbox of its own (a shell in a fresh temporary directory, or a
container), so one environment can run a batch of episodes at once. Steps are not pure: a
state stands for a live sandbox that moves on when stepped, so a state is stepped at most
once (:class:`~agile_llmenvs.errors.StaleStateError` otherwise). What is needed to rebuild a
state on a fresh instance travels in ``State.payload`` as a :class:`CommandHistory`.

An episode ends when the policy submits (``terminated``), at ``max_steps``, or when its time
budget is spent (both ``truncated``); the task's verifier then sets the reward of that step.
The time budget (``trajectory_timeout_s``) counts the seconds the episode's commands ran, not
the time spent generating between steps, which in a lock-step batch depends on the others.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

from agile_llmenvs.adapters.terminal.actions import format_observation, parse_action
from agile_llmenvs.adapters.terminal.sandbox import Sandbox, TaskSource
from agile_llmenvs.adapters.terminal.shell import CommandResult, is_incomplete
from agile_llmenvs.adapters.terminal.tasks import TaskFolder
from agile_llmenvs.core.text_env import render_action
from agile_llmenvs.core.types import Action, EnvironmentSpec, State, StepResult
from agile_llmenvs.errors import EnvStateError, StaleStateError, TaskSelectionError

__all__ = ["CommandHistory", "TerminalConfig", "TerminalEnvironment", "TimeBudget"]

_TASK_KEYS = ("task_index", "row_index")


@dataclass(frozen=True)
class TerminalConfig:
    """How terminal episodes are bounded and shown to the policy.

    Attributes:
        max_steps: Steps per episode; the step that reaches it ends the episode (truncated).
        trajectory_timeout_s: Seconds of command time per episode; ``None`` for no budget.
        command_timeout_s: Most seconds one command may run before its shell is restarted.
        max_output_chars: Longer command output is cut in the middle to this many characters.
        submit_keyword: The command that ends the episode and runs the verifier.
        show_action_help: Append the action convention to the first observation.
    """

    max_steps: int = 30
    trajectory_timeout_s: float | None = 600.0
    command_timeout_s: float = 60.0
    max_output_chars: int = 4000
    submit_keyword: str = "submit"
    show_action_help: bool = True

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.trajectory_timeout_s is not None and not self.trajectory_timeout_s > 0:
            raise ValueError(
                f"trajectory_timeout_s must be > 0 or None, got {self.trajectory_timeout_s}"
            )
        if not self.command_timeout_s > 0:
            raise ValueError(f"command_timeout_s must be > 0, got {self.command_timeout_s}")
        if self.max_output_chars < 2:
            raise ValueError(f"max_output_chars must be >= 2, got {self.max_output_chars}")
        if not self.submit_keyword.strip():
            raise ValueError("submit_keyword must be a non-empty word, got an empty string")


@dataclass(frozen=True)
class CommandHistory:
    """What rebuilds a terminal state by replay; kept in ``State.payload``.

    Attributes:
        task_index: The task's position in the env's task list.
        task_name: The task's name, to catch a task list that changed since.
        commands: The commands that ran, in order (incomplete and empty ones never run).
        budget_used_s: Seconds of the time budget the commands used.
    """

    task_index: int
    task_name: str
    commands: tuple[str, ...] = ()
    budget_used_s: float = 0.0


@dataclass
class TimeBudget:
    """An episode's time budget: ``limit_s`` seconds of command time (``None``: no limit)."""

    limit_s: float | None
    used_s: float = 0.0

    @property
    def remaining_s(self) -> float:
        """Seconds left (infinite without a limit)."""
        return math.inf if self.limit_s is None else self.limit_s - self.used_s

    @property
    def spent(self) -> bool:
        """Whether no time is left."""
        return self.remaining_s <= 0


@dataclass
class _Episode:
    sandbox: Sandbox
    history: CommandHistory
    budget: TimeBudget
    step_count: int = 0
    busy: bool = False


@dataclass(frozen=True)
class _Outcome:
    observation: str
    info: dict[str, Any] = field(default_factory=dict)
    end: str | None = None  # "submitted", "max_steps" or "time_budget"


class TerminalEnvironment:
    """Terminal tasks behind the state-passing :class:`~agile_llmenvs.core.Environment` face.

    Args:
        tasks: A folder of tasks (see :class:`TaskFolder`) or any task source (Harbor's).
        config: Step, time and output limits.
        name: A label for results; defaults to ``terminal:<folder name>``.
        sandbox: For a folder given by path: ``"bubblewrap"`` (the default) or ``"none"``
            (see :class:`TaskFolder`); a task source passed whole keeps its own.
    """

    def __init__(
        self,
        tasks: TaskSource | str | os.PathLike[str],
        config: TerminalConfig | None = None,
        *,
        name: str | None = None,
        sandbox: str = "bubblewrap",
    ) -> None:
        if isinstance(tasks, str | os.PathLike):
            tasks = TaskFolder(tasks, sandbox=sandbox)
        self.tasks = tasks
        self.config = config or TerminalConfig()
        default_name = f"terminal:{tasks.tasks_dir.name}" if isinstance(tasks, TaskFolder) else None
        self._spec = EnvironmentSpec(
            name=name or default_name or "terminal",
            pure_step=False,
            dataset_size=len(tasks.task_names),
            max_turns=self.config.max_steps,
            forkable=False,
        )
        self._episodes: dict[int, _Episode] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def spec(self) -> EnvironmentSpec:
        """Not pure, not forkable; ``dataset_size`` is the number of tasks."""
        return self._spec

    def task_name(self, task_index: int) -> str:
        """The name of task ``task_index``.

        Raises:
            TaskSelectionError: There is no such task.
        """
        names = self.tasks.task_names
        if isinstance(task_index, bool) or not isinstance(task_index, int):
            raise TaskSelectionError(f"task_index must be an int, got {task_index!r}")
        if not 0 <= task_index < len(names):
            raise TaskSelectionError(
                f"task_index {task_index} is out of range: this env has {len(names)} tasks "
                f"(0 .. {len(names) - 1})"
            )
        return names[task_index]

    def reset(
        self, *, seed: int | None = None, options: Mapping[str, Any] | None = None
    ) -> tuple[State, dict[str, Any]]:
        """Open a fresh sandbox for the task ``options`` selects and show its instruction.

        Args:
            seed: Passed to the task's setup (``TASK_SEED``) and kept in the state.
            options: ``{"task_index": i}`` or ``{"row_index": i}`` (what runners pass).

        Raises:
            TaskSelectionError: ``options`` names no task, both keys, an unknown key, or an
                index out of range.
            EnvStateError: The environment is closed.
        """
        task_index = self._task_index(options)
        name = self.task_name(task_index)
        self._check_open()
        sandbox = self.tasks.open(task_index, seed)
        try:
            observation = self.tasks.instruction(task_index) + self._action_help()
            budget = TimeBudget(self.config.trajectory_timeout_s)
            episode = _Episode(sandbox, CommandHistory(task_index, name), budget)
            with self._lock:
                self._check_open()
                episode_id = next(self._ids)
                self._episodes[episode_id] = episode
        except BaseException:
            sandbox.close()
            raise
        messages = ({"role": "user", "content": observation},)
        state = State(
            observation,
            messages,
            task=dict(options or {}),
            episode_id=episode_id,
            payload=episode.history,
            seed=seed,
        )
        info = {"task_index": task_index, "task_name": name}
        return state, info

    def step(self, state: State, action: Action) -> StepResult:
        """Run the command in ``action`` (or submit) in the sandbox behind ``state``.

        Raises:
            StaleStateError: ``state`` was stepped already, ended, or was released.
        """
        episode = self._claim(state)
        try:
            outcome = self._act(episode, action)
            done = outcome.end is not None
            reward, info = 0.0, {**outcome.info, "step": episode.step_count}
            if done:
                verdict = episode.sandbox.verify()
                reward = verdict.reward
                info.update(
                    end_reason=outcome.end,
                    verifier_output=verdict.output,
                    verifier_exit_code=verdict.exit_code,
                )
        except BaseException:
            self._drop(state.episode_id)
            raise
        episode.busy = False
        text = render_action(action)
        turns = [{"role": "assistant", "content": text}]
        if outcome.observation or not done:
            turns.append({"role": "user", "content": outcome.observation})
        next_state = replace(
            state,
            observation=outcome.observation,
            messages=(*state.messages, *turns),
            step_count=episode.step_count,
            done=done,
            payload=replace(episode.history, budget_used_s=episode.budget.used_s),
        )
        if done:
            self._drop(state.episode_id)
        truncated = outcome.end in ("max_steps", "time_budget")
        return StepResult(next_state, reward, outcome.end == "submitted", truncated, info)

    def release(self, state: State) -> None:
        """End ``state``'s episode early and close its sandbox (a no-op when already ended)."""
        self._drop(state.episode_id)

    def close(self) -> None:
        """Close every sandbox still open; the environment takes no further episodes."""
        with self._lock:
            self._closed = True
            episodes = list(self._episodes.values())
            self._episodes.clear()
        for episode in episodes:
            episode.sandbox.close()

    def __enter__(self) -> TerminalEnvironment:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # --- what restore by replay drives (agile_llmenvs.adapters.terminal.replay) ----------

    def replay_command(self, state: State, command: str) -> CommandResult:
        """Run ``command`` in ``state``'s sandbox off the clock: the time budget is not
        charged and the state does not advance (restore calls :meth:`resume` after)."""
        episode = self._claim(state)
        try:
            result = self._execute(episode, command, timeout_s=self.config.command_timeout_s)
        except BaseException:
            self._drop(state.episode_id)
            raise
        episode.busy = False
        return result

    def resume(self, state: State, target: State) -> State:
        """Take ``target``'s place with ``state``'s episode, whose sandbox has replayed
        ``target``'s commands: the step count and the budget used are ``target``'s."""
        episode = self._claim(state)
        history: CommandHistory = target.payload
        episode.step_count = target.step_count
        episode.budget.used_s = history.budget_used_s
        episode.history = history
        episode.busy = False
        return replace(target, episode_id=state.episode_id)

    # --- internals -----------------------------------------------------------------------

    def _act(self, episode: _Episode, action: Action) -> _Outcome:
        parsed = parse_action(action, self.config.submit_keyword)
        episode.step_count += 1
        if parsed.submit:
            return _Outcome("", end="submitted")
        if episode.budget.spent:
            return _Outcome(self._budget_note(), end="time_budget")
        if not parsed.command:
            observation = (
                f"[empty command, nothing was run: reply with one shell command, or "
                f"{self.config.submit_keyword!r} when the task is done]"
            )
            info: dict[str, Any] = {"command": ""}
        else:
            timeout = min(self.config.command_timeout_s, episode.budget.remaining_s)
            result = self._execute(episode, parsed.command, timeout_s=timeout)
            episode.budget.used_s += result.elapsed_s
            observation = format_observation(result, self.config.max_output_chars)
            info = _result_info(parsed.command, result)
        info["budget_left_s"] = (
            None if episode.budget.limit_s is None else episode.budget.remaining_s
        )
        if episode.budget.spent:
            return _Outcome(observation + "\n" + self._budget_note(), info, "time_budget")
        if episode.step_count >= self.config.max_steps:
            note = f"\n[step limit of {self.config.max_steps} reached: the episode is over]"
            return _Outcome(observation + note, info, "max_steps")
        return _Outcome(observation, info)

    def _execute(self, episode: _Episode, command: str, *, timeout_s: float) -> CommandResult:
        if is_incomplete(command):
            return CommandResult("", None, incomplete=True)
        result = episode.sandbox.run(command, timeout_s)
        history = episode.history
        episode.history = replace(history, commands=(*history.commands, command))
        return result

    def _budget_note(self) -> str:
        return (
            f"[time budget of {self.config.trajectory_timeout_s} s of command time spent: "
            "the episode is over]"
        )

    def _action_help(self) -> str:
        if not self.config.show_action_help:
            return ""
        return (
            "\n\nReply with one shell command per turn (a ```bash block is fine); its output "
            f"and exit status come back. Reply {self.config.submit_keyword} when the task is done."
        )

    def _task_index(self, options: Mapping[str, Any] | None) -> int:
        given = dict(options or {})
        unknown = sorted(set(given) - set(_TASK_KEYS))
        if unknown:
            raise TaskSelectionError(
                f"unknown reset option(s) {unknown}: the terminal env takes one of "
                "'task_index' or 'row_index'"
            )
        chosen = [key for key in _TASK_KEYS if key in given]
        if len(chosen) != 1:
            what = "both 'task_index' and 'row_index'" if chosen else "no task"
            raise TaskSelectionError(
                f"reset options name {what}: pass options={{'task_index': i}} "
                "(or {'row_index': i}, as runners do)"
            )
        return given[chosen[0]]  # type-checked by task_name

    def _claim(self, state: State) -> _Episode:
        with self._lock:
            self._check_open()
            episode = self._episodes.get(state.episode_id)
            if (
                episode is None
                or episode.busy
                or episode.step_count != state.step_count
                or state.done
            ):
                raise StaleStateError(
                    f"episode {state.episode_id} at step {state.step_count} cannot be stepped: "
                    "its sandbox has moved on, ended or been released (terminal steps are not "
                    "pure: step each state once; restore a state on a fresh env with "
                    "terminal_restore)"
                )
            episode.busy = True
            return episode

    def _drop(self, episode_id: int) -> None:
        with self._lock:
            episode = self._episodes.pop(episode_id, None)
        if episode is not None:
            episode.sandbox.close()

    def _check_open(self) -> None:
        if self._closed:
            raise EnvStateError("this terminal environment is closed; make a new one")


def _result_info(command: str, result: CommandResult) -> dict[str, Any]:
    return {
        "command": command,
        "exit_code": result.exit_code,
        "elapsed_s": result.elapsed_s,
        "timed_out": result.timed_out,
        "shell_restarted": result.shell_restarted,
        "incomplete": result.incomplete,
    }
