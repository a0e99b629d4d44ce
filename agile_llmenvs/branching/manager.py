"""BranchManager: named checkpoints of an env, and any number of independent branches of each."""

from __future__ import annotations

import atexit
import contextlib
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, get_args

from agile_llmenvs.branching.checkpoint import BranchStrategy, Checkpoint, HeldCheckpoint
from agile_llmenvs.branching.direct import DirectStrategy
from agile_llmenvs.branching.fork import ProcessForkStrategy
from agile_llmenvs.branching.replay import ActionReplayStrategy
from agile_llmenvs.core.types import Action, Environment, State
from agile_llmenvs.errors import BranchError

__all__ = ["BranchManager", "StrategyName", "resolve_strategy"]

StrategyName = Literal["direct", "process_fork", "action_replay"]
_STRATEGIES = get_args(StrategyName)

_open_managers: weakref.WeakSet[BranchManager] = weakref.WeakSet()


class BranchManager:
    """Checkpoints an env's states by name and hands out independent branches of them.

    A branch is an ``(env, state)`` pair that can be stepped, branched again (with a nested
    manager over the branch's env) or run to the end without touching the checkpoint or any
    other branch. Build one with :meth:`create`, and use it as a context manager: leaving the
    ``with`` block (also on an exception) releases every checkpoint and branch; an ``atexit``
    hook does the same for managers still open when the interpreter exits.

    Example:
        >>> with BranchManager.create(env) as manager:  # doctest: +SKIP
        ...     manager.checkpoint("k", state, actions, {"seed": 0, "row_index": 3})
        ...     branch_env, branch_state = manager.branch("k")
    """

    def __init__(self, strategy: BranchStrategy) -> None:
        self.strategy = strategy
        self._held: dict[str, HeldCheckpoint] = {}
        self._closed = False
        _open_managers.add(self)

    @classmethod
    def create(
        cls,
        env: Environment,
        strategy: StrategyName | None = None,
        env_factory: Callable[[], Environment] | None = None,
    ) -> BranchManager:
        """A manager over ``env`` with the named strategy, or the best one that fits.

        Args:
            env: The env whose states will be checkpointed.
            strategy: ``"direct"``, ``"process_fork"`` or ``"action_replay"``; ``None``
                picks the first that fits, in that order (see :func:`resolve_strategy`).
            env_factory: Makes fresh envs: needed by ActionReplay, and used by ProcessFork
                to rebuild an env that does not pickle.

        Raises:
            BranchError: The named strategy does not fit ``env``, or none does.
        """
        return cls(resolve_strategy(env, strategy, env_factory))

    @property
    def strategy_name(self) -> str:
        """The strategy in use: ``"direct"``, ``"process_fork"`` or ``"action_replay"``."""
        return self.strategy.name

    @property
    def names(self) -> tuple[str, ...]:
        """The checkpoints held, in the order they were made."""
        return tuple(self._held)

    def checkpoint(
        self,
        name: str,
        state: State,
        actions: Sequence[Action] = (),
        reset_options: Mapping[str, Any] | None = None,
    ) -> None:
        """Checkpoint ``state`` as ``name``; a checkpoint of the same name is replaced.

        For a non-pure env, checkpoint a state right after reaching it: ProcessFork copies
        the env as it is at this call.

        Args:
            name: The checkpoint's name.
            state: The state to branch from.
            actions: The actions taken since the reset (ActionReplay replays them).
            reset_options: The reset's ``seed`` and task options (``{"seed": 42,
                "row_index": 0}``).
        """
        self._check_open()
        checkpoint = Checkpoint(name, state, tuple(actions), dict(reset_options or {}))
        held = self.strategy.hold(checkpoint)
        previous = self._held.pop(name, None)
        self._held[name] = held
        if previous is not None:
            previous.release()

    def branch(self, name: str) -> tuple[Environment, State]:
        """A new, independent ``(env, state)`` pair at checkpoint ``name``.

        Raises:
            BranchError: No checkpoint is named ``name``, or the manager is closed.
        """
        self._check_open()
        return self._get(name).branch()

    def release(self, name: str) -> None:
        """Free checkpoint ``name`` and every branch made from it.

        Raises:
            BranchError: No checkpoint is named ``name``.
        """
        self._get(name)
        self._held.pop(name).release()

    def close(self) -> None:
        """Release every checkpoint and branch, and the strategy's own resources."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        for name in list(self._held):
            try:
                self._held.pop(name).release()
            except Exception as exc:
                errors.append(exc)
        self.strategy.close()
        _open_managers.discard(self)
        if errors:
            raise errors[0]

    def __enter__(self) -> BranchManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __contains__(self, name: object) -> bool:
        return name in self._held

    def _get(self, name: str) -> HeldCheckpoint:
        held = self._held.get(name)
        if held is None:
            known = ", ".join(repr(n) for n in self._held) or "none"
            raise BranchError(f"no checkpoint named {name!r} (checkpoints held: {known})")
        return held

    def _check_open(self) -> None:
        if self._closed:
            raise BranchError("this BranchManager is closed; create a new one")


def resolve_strategy(
    env: Environment,
    strategy: StrategyName | None = None,
    env_factory: Callable[[], Environment] | None = None,
) -> BranchStrategy:
    """The strategy named, or the first that fits ``env``: Direct for a pure-step env,
    ProcessFork for a forkable env on a platform with ``fork``, ActionReplay given an
    ``env_factory``.

    Raises:
        BranchError: The named strategy does not fit ``env``, the name is unknown, or no
            strategy fits.
    """
    if strategy == "direct":
        return DirectStrategy(env)
    if strategy == "process_fork":
        return ProcessForkStrategy(env, env_factory)
    if strategy == "action_replay":
        return ActionReplayStrategy(env_factory)
    if strategy is not None:
        raise BranchError(f"unknown branching strategy {strategy!r}; use one of {_STRATEGIES}")
    if env.spec.pure_step:
        return DirectStrategy(env)
    if env.spec.forkable and hasattr(os, "fork"):
        return ProcessForkStrategy(env, env_factory)
    if env_factory is not None:
        return ActionReplayStrategy(env_factory)
    raise BranchError(
        f"no branching strategy fits {env.spec.name!r}: it is not pure-step, not forkable, "
        "and no env_factory was given for action_replay"
    )


@atexit.register
def _close_open_managers() -> None:
    for manager in list(_open_managers):
        with contextlib.suppress(Exception):
            manager.close()
