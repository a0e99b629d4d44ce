"""ActionReplay branching: each branch is a fresh env, reset and replayed to the checkpoint."""

from __future__ import annotations

from collections.abc import Callable

from agile_llmenvs.branching.checkpoint import Checkpoint
from agile_llmenvs.core.replay import replay
from agile_llmenvs.core.types import Environment, State
from agile_llmenvs.errors import BranchError

__all__ = ["ActionReplayStrategy"]


class ActionReplayStrategy:
    """Branch by replay: ``env_factory()``, reset with the checkpoint's options, then take its
    actions again. Costs O(K) steps per branch at depth K; exact when the env is deterministic
    given its seed and task, and checked: a replay that does not reach the checkpoint's state
    raises :class:`~agile_llmenvs.errors.ReplayError`.

    Raises:
        BranchError: No ``env_factory`` was given.
    """

    name = "action_replay"

    def __init__(self, env_factory: Callable[[], Environment] | None) -> None:
        if env_factory is None:
            raise BranchError(
                "action_replay branching builds each branch from a fresh env: pass "
                "env_factory (a zero-argument callable returning an Environment)"
            )
        self.env_factory = env_factory

    def hold(self, checkpoint: Checkpoint) -> _ReplayCheckpoint:
        """Keep ``checkpoint``'s recipe (its reset options and actions).

        Raises:
            BranchError: The number of actions is not the state's step count.
        """
        if len(checkpoint.actions) != checkpoint.state.step_count:
            raise BranchError(
                f"checkpoint {checkpoint.name!r}: its state is at step "
                f"{checkpoint.state.step_count} but {len(checkpoint.actions)} actions were "
                "given; action_replay needs every action taken since the reset"
            )
        return _ReplayCheckpoint(self.env_factory, checkpoint)

    def close(self) -> None:
        """Nothing to free: each checkpoint closes its own branches."""


class _ReplayCheckpoint:
    def __init__(self, env_factory: Callable[[], Environment], checkpoint: Checkpoint) -> None:
        self.env_factory, self.checkpoint = env_factory, checkpoint
        self.envs: list[Environment] = []

    def branch(self) -> tuple[Environment, State]:
        env = self.env_factory()
        cp = self.checkpoint
        try:
            state = replay(env, cp.actions, seed=cp.seed, options=cp.task, expect=cp.state)
        except BaseException:
            env.close()
            raise
        self.envs.append(env)
        return env, state

    def release(self) -> None:
        envs, self.envs = self.envs, []
        for env in envs:
            env.close()
