"""Restore by replay: rebuild a terminal state on a fresh environment instance.

A terminal state stands for a live sandbox, which cannot be copied; what can be copied is
its :class:`~agile_llmenvs.adapters.terminal.CommandHistory`. :func:`restore_by_replay`
resets a fresh instance to the state's task and runs the state's commands again, off the
clock, then hands the episode the state's step count and budget. Both
:func:`~agile_llmenvs.adapters.terminal.terminal_restore` and
:func:`~agile_llmenvs.adapters.harbor.harbor_restore` are this routine.

Replay gives the same sandbox only when the commands are deterministic;
:func:`validate_replay_consistency` measures whether they are for a given trajectory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from agile_llmenvs.adapters.terminal.env import CommandHistory
from agile_llmenvs.adapters.terminal.shell import CommandResult
from agile_llmenvs.core.types import State
from agile_llmenvs.errors import (
    ContinuationPromptError,
    ReplayError,
    TaskMismatchError,
    TaskSelectionError,
)

__all__ = [
    "DEFAULT_PROBES",
    "SupportsReplay",
    "restore_by_replay",
    "terminal_restore",
    "validate_replay_consistency",
]

DEFAULT_PROBES = ('find "$HOME" -type f -exec md5sum {} + | sort -k 2',)
"""Fingerprints every file under the episode's home (the working directory, locally)."""


class SupportsReplay(Protocol):
    """What restore by replay needs of an environment (``TerminalEnvironment`` has it)."""

    def task_name(self, task_index: int) -> str:
        """The name of task ``task_index``; ``TaskSelectionError`` when there is none."""
        ...

    def reset(
        self, *, seed: int | None = None, options: Mapping[str, Any] | None = None
    ) -> tuple[State, dict[str, Any]]:
        """Start an episode of the task ``options`` selects."""
        ...

    def replay_command(self, state: State, command: str) -> CommandResult:
        """Run ``command`` in ``state``'s episode off the clock, without advancing it."""
        ...

    def resume(self, state: State, target: State) -> State:
        """Give ``state``'s episode ``target``'s place; returns the steppable state."""
        ...

    def release(self, state: State) -> None:
        """End ``state``'s episode and free its sandbox."""
        ...

    def close(self) -> None:
        """Free everything the environment holds."""
        ...


def restore_by_replay(env: SupportsReplay, state: State) -> State:
    """Rebuild ``state`` on ``env`` (a fresh instance) by replaying its commands.

    Checks that ``env``'s task at the state's index has the state's task name, resets that
    task with the state's seed, runs the state's commands with the time budget off (replay
    time is not charged), and re-anchors the budget so the continuation has exactly what
    ``state`` had left. The returned state equals ``state`` but for its ``episode_id`` and
    is steppable on ``env``.

    Raises:
        ReplayError: ``state`` is not a terminal state, or it is done.
        TaskMismatchError: ``env`` has another task (or none) at the state's index.
        ContinuationPromptError: A replayed command would leave the shell waiting for more
            input; ``env`` is left without the half-restored episode.
    """
    history = _history_of(state)
    _check_task(env, history)
    live, _ = env.reset(seed=state.seed, options={"task_index": history.task_index})
    try:
        for position, command in enumerate(history.commands):
            if env.replay_command(live, command).incomplete:
                raise ContinuationPromptError(
                    f"replayed command {position + 1} of {len(history.commands)} ({command!r}) "
                    "would leave the shell at a continuation prompt (an unclosed quote, "
                    "heredoc or block), so the rest of the replay would be typed into it; "
                    "this state cannot be restored by replay (its commands ran complete when "
                    "recorded: was it made by another shell version, or edited?)"
                )
        return env.resume(live, state)
    except BaseException:
        env.release(live)
        raise


def terminal_restore(env: SupportsReplay, state: State) -> State:
    """Restore a terminal ``state`` on a fresh ``env``: the ``restore_fn`` of runners.

    ``TrajectoryRunner(env, backend, env_factory=..., restore_fn=terminal_restore)`` calls it
    once per rollout, on a fresh instance from ``env_factory``. See
    :func:`restore_by_replay` for what it checks and raises.
    """
    return restore_by_replay(env, state)


def _history_of(state: State) -> CommandHistory:
    if not isinstance(state.payload, CommandHistory):
        raise ReplayError(
            f"state.payload is {type(state.payload).__name__}, not a CommandHistory: only "
            "states of a terminal (or Harbor) environment can be restored by replay"
        )
    if state.done:
        raise ReplayError(
            f"the state of task {state.payload.task_name!r} at step {state.step_count} is done; "
            "there is no continuation to restore it for"
        )
    return state.payload


def _check_task(env: SupportsReplay, history: CommandHistory) -> None:
    try:
        found = env.task_name(history.task_index)
    except TaskSelectionError as exc:
        raise TaskMismatchError(
            f"the state's task {history.task_name!r} was at index {history.task_index}, "
            f"which this env does not have ({exc}); was the task list changed?"
        ) from exc
    if found != history.task_name:
        raise TaskMismatchError(
            f"task index {history.task_index} is {found!r} in this env but "
            f"{history.task_name!r} in the state: the task list changed since the state was "
            "recorded (a different dataset version or tasks folder); restore on an env with "
            "the state's task list"
        )


def validate_replay_consistency(
    env_factory: Callable[[], SupportsReplay],
    task_index: int,
    trajectory: Sequence[str],
    probe_commands: Sequence[str] = DEFAULT_PROBES,
    num_trials: int = 3,
    *,
    reference_probes: Mapping[str, str] | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    """Whether replaying ``trajectory`` rebuilds the same sandbox every time.

    Each trial makes a fresh env, resets task ``task_index``, replays ``trajectory``, runs
    ``probe_commands`` and hashes what each printed (with its exit status); the env is closed
    whatever happens. Two modes: self-consistency (do the trials agree?) always, and
    live-versus-restored when ``reference_probes`` maps each probe to the output it gave in
    the live episode (does the first trial reproduce it?).

    Args:
        env_factory: Makes a fresh environment.
        task_index: The task to replay in.
        trajectory: The commands to replay, in order.
        probe_commands: Commands whose output fingerprints the sandbox.
        num_trials: How many independent replays to compare (at least 1).
        reference_probes: Probe outputs recorded in the live episode, to compare against.
        seed: The seed the live episode was reset with.

    Returns:
        ``consistent`` (bool): every trial's probes hashed the same;
        ``hashes`` (list[str]): one hash per trial, over all its probes;
        ``probe_hashes`` (list[list[str]]): per trial, one hash per probe;
        ``probe_outputs`` (list[dict[str, str]]): per trial, each probe's output;
        ``divergent_probes`` (list[str]): the probes whose output differed between trials;
        ``matches_reference`` (bool | None): the first trial gave ``reference_probes``'
        outputs (``None`` without them).

    Raises:
        ValueError: ``num_trials`` is below 1 or ``probe_commands`` is empty.
        ContinuationPromptError: A command of ``trajectory`` is incomplete.
    """
    if num_trials < 1:
        raise ValueError(f"num_trials must be >= 1, got {num_trials}")
    if not probe_commands:
        raise ValueError("probe_commands must name at least one command to fingerprint with")
    outputs = [
        _probe_trial(env_factory, task_index, trajectory, probe_commands, seed)
        for _ in range(num_trials)
    ]
    probe_hashes = [[_digest(f"{code}\0{text}") for code, text in trial] for trial in outputs]
    hashes = [_digest("\n".join(trial)) for trial in probe_hashes]
    divergent = [
        probe
        for i, probe in enumerate(probe_commands)
        if len({trial[i] for trial in probe_hashes}) > 1
    ]
    matches = None
    if reference_probes is not None:
        first = {probe: text for probe, (_, text) in zip(probe_commands, outputs[0], strict=True)}
        matches = all(first.get(probe) == text for probe, text in reference_probes.items())
    return {
        "consistent": len(set(hashes)) == 1,
        "hashes": hashes,
        "probe_hashes": probe_hashes,
        "probe_outputs": [
            {probe: text for probe, (_, text) in zip(probe_commands, trial, strict=True)}
            for trial in outputs
        ],
        "divergent_probes": divergent,
        "matches_reference": matches,
    }


def _probe_trial(
    env_factory: Callable[[], SupportsReplay],
    task_index: int,
    trajectory: Sequence[str],
    probe_commands: Sequence[str],
    seed: int | None,
) -> list[tuple[int | None, str]]:
    env = env_factory()
    try:
        live, _ = env.reset(seed=seed, options={"task_index": task_index})
        for position, command in enumerate(trajectory):
            if env.replay_command(live, command).incomplete:
                raise ContinuationPromptError(
                    f"trajectory command {position + 1} of {len(trajectory)} ({command!r}) "
                    "would leave the shell at a continuation prompt; fix the trajectory"
                )
        results = [env.replay_command(live, probe) for probe in probe_commands]
        return [(result.exit_code, result.output) for result in results]
    finally:
        env.close()


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
