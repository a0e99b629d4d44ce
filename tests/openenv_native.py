"""OpenEnv-native envs for the conformance tests: written against OpenEnv's own base classes,
as a user of OpenEnv would write them, with nothing of ours inside."""

from __future__ import annotations

from typing import Any

from agile_llmenvs.transport._openenv import Action, Environment, Observation, State


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    echoed: str
    length: int


class EchoEnvironment(Environment):
    """Echoes each message back with its length; ``"bye"`` ends the episode."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=None, step_count=0)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> EchoObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return EchoObservation(echoed="", length=0, metadata={"seed": seed})

    def step(
        self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any
    ) -> EchoObservation:
        self._state.step_count += 1
        done = action.message == "bye"
        return EchoObservation(
            echoed=action.message,
            length=len(action.message),
            reward=float(len(action.message)),
            done=done,
        )

    @property
    def state(self) -> State:
        return self._state


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    text: str
    attempts_left: int


class GuessState(State):
    attempts_left: int = 3


class GuessEnvironment(Environment):
    """Guess the number 7 in three attempts; reward 1 for the right guess."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = GuessState(episode_id=None, step_count=0)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        self._state = GuessState(episode_id=episode_id, step_count=0, attempts_left=3)
        return GuessObservation(text="Guess a number from 1 to 10.", attempts_left=3)

    def step(
        self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any
    ) -> GuessObservation:
        state = self._state
        state.step_count += 1
        state.attempts_left -= 1
        right = action.guess.strip() == "7"
        hint = "Right!" if right else f"{action.guess} is wrong."
        return GuessObservation(
            text=hint,
            attempts_left=state.attempts_left,
            reward=1.0 if right else 0.0,
            done=right or state.attempts_left == 0,
        )

    @property
    def state(self) -> GuessState:
        return self._state


def make_tools_environment() -> Environment:
    """An MCP env with two tools, ``add`` and ``shout``, on OpenEnv's ``MCPEnvironment``."""
    from fastmcp import FastMCP
    from openenv.core.env_server.mcp_environment import MCPEnvironment

    class ToolsEnvironment(MCPEnvironment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            server = FastMCP("tools")

            @server.tool
            def add(a: int, b: int) -> int:
                """Add two integers."""
                return a + b

            @server.tool
            def shout(text: str) -> str:
                """Upper-case a text."""
                return text.upper()

            super().__init__(server)
            self._state = State(episode_id=None, step_count=0)

        def reset(
            self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
        ) -> Observation:
            self._state = State(episode_id=episode_id, step_count=0)
            return Observation(metadata={"ready": True})

        def _step_impl(
            self, action: Action, timeout_s: float | None = None, **kwargs: Any
        ) -> Observation:
            return Observation(metadata={"error": f"unknown action {type(action).__name__}"})

        @property
        def state(self) -> State:
            return self._state

    return ToolsEnvironment()
