"""Rebuild an episode by replay: reset with the recorded seed and task, take the same actions.

This is how a fresh environment instance is brought to a recorded :class:`State` when the
env is deterministic given its seed and task: the generic ``restore_fn`` of the multi-instance
runner, and the work ``ActionReplay`` branching does per branch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agile_llmenvs.core.types import Action, Environment, State
from agile_llmenvs.errors import ReplayError

__all__ = ["actions_of", "replay", "replay_restore"]


def replay(
    env: Environment,
    actions: Sequence[Action],
    *,
    seed: int | None = None,
    options: Mapping[str, Any] | None = None,
    expect: State | None = None,
) -> State:
    """Reset ``env`` and take ``actions`` in order; returns the state reached.

    Args:
        env: The environment to replay on (a fresh instance, for a non-pure env).
        actions: The actions to take after the reset.
        seed: The seed of the reset.
        options: The task of the reset.
        expect: When given, the state the replay must reach: its observation, step count
            and done flag are compared.

    Raises:
        ReplayError: The episode ended before the last action, or the state reached is not
            ``expect``.
    """
    state, _ = env.reset(seed=seed, options=options)
    for taken, action in enumerate(actions):
        if state.done:
            raise ReplayError(
                f"the replayed episode ended after {taken} of {len(actions)} actions; "
                "the env is not deterministic given its seed and task"
            )
        state = env.step(state, action).next_state
    if expect is not None:
        reached = (state.observation, state.step_count, state.done)
        wanted = (expect.observation, expect.step_count, expect.done)
        if reached != wanted:
            raise ReplayError(
                f"replaying {len(actions)} actions reached (observation, step_count, done) = "
                f"{_short(reached)}, not the recorded {_short(wanted)}; the env is not "
                "deterministic given its seed and task (use ProcessFork branching instead)"
            )
    return state


def actions_of(state: State) -> tuple[Action, ...]:
    """The actions taken to reach ``state``: its assistant turns, as text."""
    return tuple(
        Action.from_text(str(message["content"]))
        for message in state.messages
        if message["role"] == "assistant"
    )


def replay_restore(env: Environment, state: State) -> State:
    """A ``restore_fn`` for deterministic envs: replay ``state``'s actions on a fresh ``env``.

    Resets with the state's ``seed`` and ``task`` and takes its assistant turns again.

    Raises:
        ReplayError: The replay did not reach ``state``.
    """
    return replay(env, actions_of(state), seed=state.seed, options=state.task, expect=state)


def _short(values: tuple[Any, ...]) -> str:
    text = repr(values)
    return text if len(text) <= 160 else text[:157] + "..."
