"""Direct branching: a pure-step env is its own copy, at no cost."""

from __future__ import annotations

from agile_llmenvs.branching.checkpoint import Checkpoint
from agile_llmenvs.core.types import Environment, State
from agile_llmenvs.errors import BranchError

__all__ = ["DirectStrategy"]


class DirectStrategy:
    """Branches share the env itself: its ``step`` is a function of the state value, so any
    number of branches can step the same checkpoint state without touching one another.

    Raises:
        BranchError: The env's ``spec.pure_step`` is False.
    """

    name = "direct"

    def __init__(self, env: Environment) -> None:
        if not env.spec.pure_step:
            raise BranchError(
                f"direct branching needs a pure-step env; {env.spec.name!r} has "
                "spec.pure_step=False (its states stand for live episodes). Use "
                "strategy='process_fork', or 'action_replay' with an env_factory"
            )
        self.env = env

    def hold(self, checkpoint: Checkpoint) -> _DirectCheckpoint:
        """Keep ``checkpoint``: nothing to copy."""
        return _DirectCheckpoint(self.env, checkpoint.state)

    def close(self) -> None:
        """Nothing to free."""


class _DirectCheckpoint:
    def __init__(self, env: Environment, state: State) -> None:
        self.env, self.state = env, state

    def branch(self) -> tuple[Environment, State]:
        return self.env, self.state

    def release(self) -> None:
        pass
