"""What a checkpoint is, and the two small protocols every branching strategy implements."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from agile_llmenvs.core.types import Action, Environment, State

__all__ = ["BranchStrategy", "Checkpoint", "HeldCheckpoint"]


@dataclass(frozen=True)
class Checkpoint:
    """A named point of an episode that branches start from.

    Attributes:
        name: The name ``branch`` and ``release`` use.
        state: The state to branch from.
        actions: The actions taken from the reset to ``state`` (ActionReplay replays them).
        reset_options: What the episode was reset with: ``seed`` goes to ``reset(seed=...)``,
            every other key into ``reset(options=...)`` (``{"seed": 42, "row_index": 0}``).
    """

    name: str
    state: State
    actions: tuple[Action, ...] = ()
    reset_options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def seed(self) -> int | None:
        """The seed of the reset, if one was recorded."""
        seed = self.reset_options.get("seed")
        return None if seed is None else int(seed)

    @property
    def task(self) -> dict[str, Any]:
        """The reset options other than the seed."""
        return {key: value for key, value in self.reset_options.items() if key != "seed"}


class HeldCheckpoint(Protocol):
    """A checkpoint a strategy keeps ready to branch from."""

    def branch(self) -> tuple[Environment, State]:
        """A new, independent ``(env, state)`` pair at the checkpoint."""
        ...

    def release(self) -> None:
        """Free the checkpoint and every branch made from it."""
        ...


class BranchStrategy(Protocol):
    """How independent copies of an env are made."""

    name: str

    def hold(self, checkpoint: Checkpoint) -> HeldCheckpoint:
        """Keep ``checkpoint`` ready to branch from."""
        ...

    def close(self) -> None:
        """Free what the strategy itself holds (after every checkpoint was released)."""
        ...
