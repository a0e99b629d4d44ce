"""Text envs for the transport and rollout tests: importable by path, so servers in
subprocesses build them.

Every observation names the action it answers, so a test can check each reply against its
own request.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np


class EchoEnv:
    """Echoes each action with a turn counter; ``stop`` terminates, ``sleep:S`` waits S s,
    ``boom`` raises ``ValueError``."""

    dataset_size = 3
    max_turns = 5

    def __init__(self, greeting: str = "start") -> None:
        self.greeting = greeting
        self.turn = 0
        self.closed = False

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        self.turn = 0
        return f"{self.greeting} seed={seed}", {"task": task, "seed": seed}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if action == "boom":
            raise ValueError("the env exploded")
        if action.startswith("sleep:"):
            time.sleep(float(action.split(":", 1)[1]))
        self.turn += 1
        done = action == "stop"
        info: dict[str, Any] = {"turn": np.int64(self.turn), "scores": (1.5, 2.5)}
        if done:
            info.update(question="what to say?", answer="stop")
        truncated = self.turn >= self.max_turns and not done
        return f"{self.turn}:{action}", float(self.turn), done, truncated, info

    def close(self) -> None:
        self.closed = True


def make(env_id: str, **kwargs: Any) -> EchoEnv:
    """A registry-style factory: ``make("echo-v0", greeting=...)``."""
    if env_id != "echo-v0":
        raise KeyError(f"unknown env id {env_id!r}")
    return EchoEnv(**kwargs)


class BrokenFactoryEnv:
    """An env whose constructor fails, for FACTORY_ERROR."""

    def __init__(self) -> None:
        raise RuntimeError("cannot build this env")


SESSION_COUNT = 0


class ScriptedEnv:
    """Shows ``observations[0]`` on reset and ``observations[k + 1]`` after turn ``k``.

    The reward of turn ``k`` is ``k + 1``; the env terminates after the last observation,
    or truncates there when ``truncate`` is set. Every action is recorded.
    """

    def __init__(self, observations: Sequence[str], *, truncate: bool = False) -> None:
        self.observations = list(observations)
        self.truncate = truncate
        self.actions: list[str] = []

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        self.actions = []
        return self.observations[0], {"task": task}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.actions.append(action)
        turn = len(self.actions)
        last = turn >= len(self.observations) - 1
        observation = self.observations[min(turn, len(self.observations) - 1)]
        terminated, truncated = (last and not self.truncate), (last and self.truncate)
        return observation, float(turn), terminated, truncated, {"turn": turn}

    def close(self) -> None:
        pass


class RowEnv:
    """A dataset env of ``rows`` rows: row ``r`` asks for its number, for ``turns`` turns.

    Each turn pays 1.0 when the action is the row number. An action ``hang`` blocks for
    ``hang_s`` seconds; resetting to a row in ``fail_rows`` raises.
    """

    def __init__(
        self, rows: int = 8, turns: int = 1, fail_rows: Sequence[int] = (), hang_s: float = 30.0
    ) -> None:
        self.dataset_size = rows
        self.turns = turns
        self.fail_rows = set(fail_rows)
        self.hang_s = hang_s
        self.row = -1
        self.turn = 0

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        self.row = int(task.get("row_index", 0))
        if self.row in self.fail_rows:
            raise RuntimeError(f"row {self.row} cannot be loaded")
        self.turn = 0
        return f"Say {self.row}.", {"row": self.row, "seed": seed}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if action.strip() == "hang":
            time.sleep(self.hang_s)
        self.turn += 1
        reward = 1.0 if action.strip() == str(self.row) else 0.0
        return f"Again: say {self.row}.", reward, self.turn >= self.turns, False, {}

    def close(self) -> None:
        pass


class SeededTurnsEnv:
    """An episode lasts ``1 + seed % 3`` turns, so episodes of different tasks (and the
    processes that play them) take different numbers of turns; the reward is the share of
    digits in the action."""

    max_turns = 3

    def __init__(self) -> None:
        self.turn, self.length = 0, 1

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        self.turn, self.length = 0, 1 + (seed or 0) % 3
        return f"Say {self.length} digits, one per turn.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        reward = sum(c.isdigit() for c in action) / max(len(action), 1)
        return f"turn {self.turn}", reward, self.turn >= self.length, False, {}

    def close(self) -> None:
        pass


class ToolEnv:
    """An OpenEnv MCP environment with tools ``add`` and ``mul`` (calls recorded in order)."""

    def __new__(cls) -> Any:
        from fastmcp import FastMCP
        from openenv.core.env_server.mcp_environment import MCPEnvironment
        from openenv.core.env_server.types import Observation, State

        class _Env(MCPEnvironment):  # type: ignore[misc]
            def __init__(self) -> None:
                mcp = FastMCP("calc")

                @mcp.tool()
                def add(a: int, b: int) -> int:
                    """Add two integers."""
                    self.calls.append(("add", a, b))
                    return a + b

                @mcp.tool()
                def mul(a: int, b: int) -> int:
                    """Multiply two integers."""
                    self.calls.append(("mul", a, b))
                    return a * b

                self.calls: list[tuple[str, int, int]] = []
                super().__init__(mcp)

            def reset(self, seed: Any = None, episode_id: Any = None, **kw: Any) -> Any:
                return Observation(done=False, reward=None, metadata={"prompt": "add 2 and 3"})

            def _step_impl(self, action: Any, timeout_s: Any = None, **kw: Any) -> Any:
                return Observation(done=False, reward=0.0)

            @property
            def state(self) -> Any:
                return State(episode_id=None, step_count=0)

        return _Env()


class SumToolEnv:
    """An OpenEnv MCP environment with one tool, ``add``: the task (from the reset seed) asks
    for the sum of two numbers, and a call of ``add`` on exactly those numbers scores 1 (any
    other call 0). Two turns an episode."""

    def __new__(cls) -> Any:
        from fastmcp import FastMCP
        from openenv.core.env_server.mcp_environment import MCPEnvironment
        from openenv.core.env_server.mcp_types import CallToolAction
        from openenv.core.env_server.types import Observation, State

        class _Env(MCPEnvironment):  # type: ignore[misc]
            def __init__(self) -> None:
                mcp = FastMCP("sum")

                @mcp.tool()
                def add(a: int, b: int) -> int:
                    """Add two integers."""
                    return a + b

                self.numbers = (0, 0)
                super().__init__(mcp)

            def reset(self, seed: Any = None, episode_id: Any = None, **kw: Any) -> Any:
                self.numbers = (2, 3) if not seed or seed % 2 == 0 else (4, 5)
                prompt = f"Add {self.numbers[0]} and {self.numbers[1]} with the add tool."
                return Observation(done=False, reward=None, metadata={"prompt": prompt})

            def step(self, action: Any, timeout_s: Any = None, **kw: Any) -> Any:
                observation = super().step(action, timeout_s=timeout_s, **kw)
                if isinstance(action, CallToolAction):
                    asked = (action.arguments.get("a"), action.arguments.get("b"))
                    observation.reward = float(asked == self.numbers)
                return observation

            def _step_impl(self, action: Any, timeout_s: Any = None, **kw: Any) -> Any:
                return Observation(done=False, reward=0.0)

            @property
            def state(self) -> Any:
                return State(episode_id=None, step_count=0, max_turns=2)

        return _Env()


class HostileEnv(EchoEnv):
    """An :class:`EchoEnv` whose ``exit`` action raises ``SystemExit`` and ``interrupt``
    raises ``KeyboardInterrupt``: what a broken env does to a server that lets them through."""

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if action == "exit":
            raise SystemExit(3)
        if action == "interrupt":
            raise KeyboardInterrupt
        return super().step(action)


class NonFiniteRewardEnv:
    """A single-turn env whose episodes score NaN, infinity, 1.0, NaN, ... (counted per
    instance, so a group mixes them)."""

    max_turns = 1

    def __init__(self) -> None:
        self.episodes = 0

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        self.episodes += 1
        return "Say a digit.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        reward = (1.0, math.nan, math.inf)[self.episodes % 3]
        return "", reward, True, False, {}

    def close(self) -> None:
        pass
