"""Interoperability both ways with OpenEnv itself: its client, its server, its MCP envs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from echo_envs import EchoEnv
from serving import UvicornApp

from agile_llmenvs.errors import EnvExecutionError
from agile_llmenvs.transport import (
    OpenEnvServer,
    OpenEnvWrapper,
    RemoteEnvClient,
    TextAction,
    TextObservation,
)


@pytest.fixture
def openenv_server() -> Iterator[UvicornApp]:
    from openenv.core.env_server.http_server import create_app

    app = create_app(
        lambda: OpenEnvWrapper(EchoEnv(), owns_inner=True),
        TextAction,
        TextObservation,
        max_concurrent_envs=4,
    )
    served = UvicornApp(app)
    yield served
    served.close()


def test_openenv_client_drives_our_server_through_an_episode() -> None:
    from openenv.core import GenericEnvClient

    async def episode(url: str) -> list[Any]:
        async with GenericEnvClient(base_url=url) as client:
            results = [await client.reset(seed=4)]
            for text in ("a", "stop"):
                results.append(await client.step({"message": text}))
            results.append(await client.state())
            return results

    with OpenEnvServer(make_env=EchoEnv, max_concurrent_envs=2) as server:
        reset, first, last, state = asyncio.run(episode(server.url))
    assert reset.observation["prompt"] == "start seed=4"
    assert (reset.reward, reset.done) == (None, False)
    assert first.observation["prompt"] == "1:a"
    assert (first.reward, first.done) == (1.0, False)
    assert last.observation["prompt"] == "2:stop"
    assert (last.reward, last.done) == (2.0, True)
    assert last.observation["answer"] == "stop"
    assert state["step_count"] == 2
    assert state["dataset_size"] == 3


def test_our_client_drives_openenv_create_app_server(openenv_server: UvicornApp) -> None:
    with RemoteEnvClient(openenv_server.url, timeout_s=10) as client:
        reset = client.reset(seed=9, row_index=0)
        assert reset.prompt == "start seed=9"
        assert reset.metadata == {"task": {"row_index": 0}, "seed": 9}
        replies = [client.step(text) for text in ("x", "stop")]
        assert [r.prompt for r in replies] == ["1:x", "2:stop"]
        assert [r.done for r in replies] == [False, True]
        assert replies[-1].observation["question"] == "what to say?"
        assert client.state()["step_count"] == 2
        with pytest.raises(EnvExecutionError, match=r"the env exploded \[code EXECUTION_ERROR\]"):
            client.step("boom")


def _calculator_env() -> Any:
    from fastmcp import FastMCP
    from openenv.core.env_server.mcp_environment import MCPEnvironment
    from openenv.core.env_server.types import Observation, State

    class ShoutEnv(MCPEnvironment):  # type: ignore[misc]
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            mcp = FastMCP("shout")

            @mcp.tool()
            def shout(message: str) -> str:
                """Upper-case the message."""
                return message.upper() + "!"

            super().__init__(mcp)
            self._state = State(episode_id=None, step_count=0)

        def reset(self, seed: Any = None, episode_id: Any = None, **kwargs: Any) -> Any:
            return Observation(done=False, reward=None, metadata={"ready": True})

        def _step_impl(self, action: Any, timeout_s: Any = None, **kwargs: Any) -> Any:
            return Observation(done=False, reward=0.0)

        @property
        def state(self) -> Any:
            return self._state

    return ShoutEnv()


def test_an_openenv_mcp_tool_is_called_through_mcp_tool() -> None:
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

    served = UvicornApp(
        create_app(_calculator_env, CallToolAction, CallToolObservation, max_concurrent_envs=2)
    )
    try:
        with RemoteEnvClient(served.url, mcp_tool="shout", timeout_s=10) as client:
            assert client.reset().metadata == {"ready": True}
            reply = client.step("hello there")
            assert reply.prompt == "HELLO THERE!"
            assert reply.observation["tool_name"] == "shout"
        with RemoteEnvClient(served.url, mcp_tool="whisper", timeout_s=10) as client:
            client.reset()
            assert client.step("x").prompt == "Error: Unknown tool: 'whisper'"
    finally:
        served.close()
