"""Conformance: OpenEnvServer against OpenEnv's own ``create_app``, reply by reply.

The same OpenEnv-native envs (a text env, one with its own action class, an MCP env with two
tools) are served once by ``create_app`` under uvicorn and once by :class:`OpenEnvServer`,
and driven by the same scripts through OpenEnv's own clients (``GenericEnvClient``, a typed
``EnvClient`` subclass, ``MCPToolClient``), raw WebSocket frames, plain HTTP and our
:class:`RemoteEnvClient`. Every reply is recorded and the two records must be equal. The one
intended difference (docs/openenv.md, "Conformance") is tested on its own at the end.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from openenv_native import (
    EchoAction,
    EchoEnvironment,
    EchoObservation,
    GuessAction,
    GuessEnvironment,
    GuessObservation,
    GuessState,
    make_tools_environment,
)
from serving import UvicornApp
from websockets.sync.client import connect

from agile_llmenvs.transport import OpenEnvServer, RemoteEnvClient
from agile_llmenvs.transport._openenv import CallToolAction, CallToolObservation, State

httpx = pytest.importorskip("httpx")

Record = list[Any]


@pytest.fixture(scope="module")
def create_app() -> Callable[..., Any]:
    from openenv.core.env_server.http_server import create_app

    return create_app


CASES: dict[str, dict[str, Any]] = {
    "echo": {"factory": EchoEnvironment, "classes": (EchoAction, EchoObservation, State)},
    "guess": {"factory": GuessEnvironment, "classes": (GuessAction, GuessObservation, GuessState)},
    "tools": {
        "factory": make_tools_environment,
        "classes": (CallToolAction, CallToolObservation, State),
        "ours_told": True,  # an MCPEnvironment's step is annotated with the base Action
    },
}


@contextmanager
def both(create_app: Callable[..., Any], case: str) -> Iterator[tuple[str, str]]:
    """(OpenEnv's url, our url) serving ``case``; ours infers the classes when it can."""
    spec = CASES[case]
    action, observation, state = spec["classes"]
    app = create_app(spec["factory"], action, observation, max_concurrent_envs=8, state_cls=state)
    told: dict[str, Any] = {}
    if spec.get("ours_told"):
        told = {"action_cls": action, "observation_cls": observation, "state_cls": state}
    with UvicornApp(app) as theirs, OpenEnvServer(make_env=spec["factory"], **told) as ours:
        yield theirs.url, ours.url


def ws_frames(url: str, frames: list[Any]) -> Record:
    """Send each frame on one ``/ws`` session and record each reply; then ``close``."""
    record: Record = []
    with connect(url.replace("http://", "ws://") + "/ws", compression=None) as ws:
        for frame in frames:
            ws.send(frame if isinstance(frame, str) else json.dumps(frame))
            record.append(json.loads(ws.recv(timeout=10)))
        ws.send(json.dumps({"type": "close"}))
        try:
            extra = ws.recv(timeout=5)
        except Exception as closed:  # the server closes with no reply frame
            record.append(("closed", getattr(getattr(closed, "rcvd", None), "code", None)))
        else:
            record.append(("unexpected reply", extra))
    return record


def http_calls(url: str, calls: list[tuple[str, str, Any]]) -> Record:
    """Each (method, path, JSON body or raw bytes) as plain HTTP: status, type and body."""
    record: Record = []
    for method, path, body in calls:
        if isinstance(body, bytes):
            response = httpx.request(method, url + path, content=body, timeout=10)
        elif body is None:
            response = httpx.request(method, url + path, timeout=10)
        else:
            response = httpx.request(method, url + path, json=body, timeout=10)
        kind = response.headers.get("content-type", "").split(";")[0]
        payload = response.json() if kind == "application/json" else response.text
        record.append((response.status_code, kind, payload))
    return record


ROUTES = [
    ("GET", "/health", None),
    ("GET", "/metadata", None),
    ("GET", "/schema", None),
    ("GET", "/state", None),
    ("POST", "/reset", {}),
    ("POST", "/reset", {"seed": 5, "episode_id": "http-1", "unknown_kwarg": 1}),
    ("POST", "/step", {}),
    ("POST", "/step", b"{not json"),
    ("POST", "/mcp", {"jsonrpc": "2.0", "method": "tools/list", "id": 1}),
    ("POST", "/mcp", {"jsonrpc": "2.0", "method": "resources/list", "id": 2}),
    ("POST", "/mcp", {"method": "tools/list"}),
    ("POST", "/mcp", b"{not json"),
    ("GET", "/nowhere", None),
    ("GET", "/step", None),
    ("POST", "/health", {}),
]

COMMON_FRAMES: list[Any] = [
    {"type": "state"},
    {"type": "teleport"},
    "{not json",
    {"type": "reset", "data": {"seed": 3, "episode_id": "ep-1", "not_a_kwarg": True}},
    {"type": "state"},
    {"type": "mcp", "data": {"jsonrpc": "2.0", "method": "tools/list", "id": 7}},
    {"type": "mcp", "data": {"id": 8}},
]


# -- a text env ------------------------------------------------------------------------------


def test_a_text_env_answers_every_frame_and_route_as_create_app_does(create_app: Any) -> None:
    frames = [
        *COMMON_FRAMES,
        {"type": "step", "data": {"message": "hello"}},
        {"type": "step", "data": {"message": "hi", "metadata": {"tag": 1}}},
        {"type": "step", "data": {"text": "wrong field"}},
        {"type": "step", "data": {"message": 5}},
        {"type": "step", "data": {"message": "bye"}},
        {"type": "step", "data": {"message": "after done"}},  # OpenEnv still runs it
        {"type": "state"},
    ]
    routes = [
        *ROUTES,
        ("POST", "/step", {"action": {"message": "over http"}}),
        ("POST", "/step", {"action": {"message": "x", "extra": 1}, "timeout_s": 3}),
        ("POST", "/step", {"action": {"message": "x"}, "timeout_s": -1}),
    ]
    with both(create_app, "echo") as (theirs, ours):
        mine = ws_frames(ours, frames)
        assert mine == ws_frames(theirs, frames)
        assert http_calls(ours, routes) == http_calls(theirs, routes)
    # pinned by hand: a step reply in OpenEnv's layout
    assert mine[7] == {
        "type": "observation",
        "data": {
            "observation": {"echoed": "hello", "length": 5, "metadata": {}},
            "reward": 5.0,
            "done": False,
        },
    }
    assert mine[3]["data"]["observation"]["metadata"] == {"seed": 3}
    assert mine[4] == {"type": "state", "data": {"episode_id": "ep-1", "step_count": 0}}


def test_openenv_generic_client_sees_the_same_episode(create_app: Any) -> None:
    from openenv.core.generic_client import GenericEnvClient

    def drive(url: str) -> Record:
        with GenericEnvClient(base_url=url).sync() as env:
            results = [
                env.reset(seed=1),
                env.step({"message": "abc"}),
                env.step({"message": "bye"}),
            ]
            record: Record = [(r.observation, r.reward, r.done, r.metadata) for r in results]
            record.append(env.state())
        return record

    with both(create_app, "echo") as (theirs, ours):
        mine = drive(ours)
        assert mine == drive(theirs)
    assert mine[0] == (
        {"echoed": "", "length": 0, "metadata": {"seed": 1}},
        None,
        False,
        {"seed": 1},
    )
    assert mine[2] == ({"echoed": "bye", "length": 3, "metadata": {}}, 3.0, True, None)


# -- an env with its own action class --------------------------------------------------------


def test_a_custom_action_class_is_validated_like_create_app_validates_it(create_app: Any) -> None:
    frames = [
        *COMMON_FRAMES,
        {"type": "step", "data": {"guess": "3"}},
        {"type": "step", "data": {"message": "3"}},  # our text action's field: refused
        {"type": "step", "data": {"guess": "3", "confidence": 0.9}},
        {"type": "step", "data": {}},
        {"type": "step", "data": {"type": "list_tools"}},
        {"type": "step", "data": {"guess": "7"}},
        {"type": "state"},
    ]
    routes = [
        *ROUTES,
        ("POST", "/step", {"action": {"guess": "7"}}),
        ("POST", "/step", {"action": {"guezz": "7"}}),
    ]
    with both(create_app, "guess") as (theirs, ours):
        mine = ws_frames(ours, frames)
        assert mine == ws_frames(theirs, frames)
        assert http_calls(ours, routes) == http_calls(theirs, routes)
    assert mine[7]["data"] == {
        "observation": {"text": "3 is wrong.", "attempts_left": 2, "metadata": {}},
        "reward": 0.0,
        "done": False,
    }
    refused = mine[8]["data"]
    assert (refused["code"], refused["message"]) == ("VALIDATION_ERROR", "Invalid message")
    assert [(e["type"], e["loc"]) for e in refused["errors"]] == [
        ("missing", ["guess"]),
        ("extra_forbidden", ["message"]),
    ]
    assert mine[-2] == {
        "type": "state",
        "data": {"episode_id": "ep-1", "step_count": 2, "attempts_left": 1},
    }


def test_schema_names_the_env_own_classes_inferred_from_its_annotations(create_app: Any) -> None:
    with both(create_app, "guess") as (_, ours):
        schema = httpx.get(ours + "/schema", timeout=10).json()
    assert schema["action"] == GuessAction.model_json_schema()
    assert schema["observation"] == GuessObservation.model_json_schema()
    assert schema["reset_observation"] == GuessObservation.model_json_schema()
    assert schema["state"] == GuessState.model_json_schema()


def test_a_typed_openenv_client_subclass_drives_both(create_app: Any) -> None:
    from openenv.core.client_types import StepResult
    from openenv.core.env_client import EnvClient

    class GuessClient(EnvClient[GuessAction, GuessObservation, GuessState]):
        def _step_payload(self, action: GuessAction) -> dict[str, Any]:
            return action.model_dump(exclude={"metadata"})

        def _parse_result(self, payload: dict[str, Any]) -> StepResult[GuessObservation]:
            observation = GuessObservation(
                **payload["observation"], reward=payload.get("reward"), done=payload["done"]
            )
            return StepResult(observation, payload.get("reward"), payload["done"])

        def _parse_state(self, payload: dict[str, Any]) -> GuessState:
            return GuessState(**payload)

    def drive(url: str) -> Record:
        with GuessClient(base_url=url).sync() as env:
            record: Record = [env.reset().observation]
            for guess in ("1", "2", "3"):
                result = env.step(GuessAction(guess=guess))
                record.append((result.observation, result.reward, result.done))
            record.append(env.state())
        return record

    with both(create_app, "guess") as (theirs, ours):
        mine = drive(ours)
        assert mine == drive(theirs)
    assert mine[-1] == GuessState(episode_id=None, step_count=3, attempts_left=0)
    assert mine[-2][1:] == (0.0, True)


# -- an MCP env ------------------------------------------------------------------------------


def test_an_mcp_env_answers_tools_list_and_call_on_every_path(create_app: Any) -> None:
    def rpc(method: str, rid: int, **params: Any) -> dict[str, Any]:
        return {"jsonrpc": "2.0", "method": method, "params": params, "id": rid}

    frames = [
        {"type": "reset"},
        {"type": "mcp", "data": rpc("tools/list", 1)},
        {"type": "mcp", "data": rpc("tools/call", 2, name="add", arguments={"a": 2, "b": 3})},
        {"type": "mcp", "data": rpc("tools/call", 3, name="missing", arguments={})},
        {"type": "mcp", "data": rpc("tools/call", 4, arguments={})},
        {"type": "mcp", "data": rpc("prompts/list", 5)},
        {"type": "step", "data": {"type": "list_tools"}},
        {
            "type": "step",
            "data": {"type": "call_tool", "tool_name": "shout", "arguments": {"text": "hi"}},
        },
        {
            "type": "step",
            "data": {"type": "call_tool", "tool_name": "add", "arguments": {"a": "x"}},
        },
        {"type": "state"},
    ]
    routes = [
        ("POST", "/mcp", rpc("tools/list", 1)),
        ("POST", "/mcp", rpc("tools/call", 2, name="shout", arguments={"text": "abc"})),
        ("POST", "/mcp", rpc("tools/list", 3, session_id="no-such-session")),
        ("GET", "/schema", None),
    ]
    with both(create_app, "tools") as (theirs, ours):
        mine = ws_frames(ours, frames)
        assert mine == ws_frames(theirs, frames)
        assert http_calls(ours, routes) == http_calls(theirs, routes)
    listed = mine[1]["data"]["result"]["tools"]
    assert [(t["name"], t["description"]) for t in listed] == [
        ("add", "Add two integers."),
        ("shout", "Upper-case a text."),
    ]
    assert listed[0]["inputSchema"]["properties"] == {
        "a": {"type": "integer"},
        "b": {"type": "integer"},
    }
    assert mine[2]["data"]["result"]["data"] == 5
    assert mine[5]["data"]["error"] == {
        "code": -32601,
        "message": "Method not found: prompts/list",
        "data": None,
    }
    assert mine[7]["data"]["observation"]["result"]["data"] == "HI"


def test_openenv_mcp_tool_client_lists_and_calls_tools_on_both(create_app: Any) -> None:
    from openenv.core.mcp_client import MCPToolClient

    async def drive(url: str) -> Record:
        async with MCPToolClient(base_url=url) as env:
            await env.reset()
            tools = await env.list_tools()
            return [
                [tool.model_dump() for tool in tools],
                await env.call_tool("add", a=4, b=5),
                await env.call_tool("shout", text="yo"),
                [tool.name for tool in await env.list_tools(use_cache=False)],
            ]

    with both(create_app, "tools") as (theirs, ours):
        mine = asyncio.run(drive(ours))
        assert mine == asyncio.run(drive(theirs))
    assert [tool["name"] for tool in mine[0]] == ["add", "shout"]
    assert mine[1:] == [9, "YO", ["add", "shout"]]


# -- our own client, on both servers ---------------------------------------------------------


def test_our_remote_client_reads_both_servers_alike(create_app: Any) -> None:
    def drive(url: str) -> Record:
        with RemoteEnvClient(url, action_field="guess") as client:
            first = client.reset()
            replies = [client.step(guess) for guess in ("2", "7")]
            return [
                (first.observation, first.reward, first.done),
                *[(r.observation, r.reward, r.done) for r in replies],
                client.state(),
            ]

    with both(create_app, "guess") as (theirs, ours):
        mine = drive(ours)
        assert mine == drive(theirs)
    assert mine[0] == (
        {"text": "Guess a number from 1 to 10.", "attempts_left": 3},
        None,  # after reset there is no reward: None, as OpenEnv sends it
        False,
    )
    assert mine[2][1:] == (1.0, True)


# -- the intended difference -----------------------------------------------------------------


class _Failing(EchoEnvironment):
    def step(self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any) -> Any:
        raise KeyError(action.message)


def test_an_env_exception_names_its_type_where_create_app_sends_only_the_text(
    create_app: Any,
) -> None:
    frames: list[Any] = [{"type": "reset"}, {"type": "step", "data": {"message": "k"}}]
    app = create_app(_Failing, EchoAction, EchoObservation, max_concurrent_envs=2)
    with UvicornApp(app) as theirs, OpenEnvServer(make_env=_Failing) as ours:
        assert ws_frames(theirs.url, frames)[1] == {
            "type": "error",
            "data": {"message": "'k'", "code": "EXECUTION_ERROR"},
        }
        line = inspect.getsourcelines(_Failing.step)[1] + 1  # the line of the raise
        where = os.path.relpath(__file__)  # a file under the working folder: relative to it
        where = __file__ if where.startswith(os.pardir) else where
        assert ws_frames(ours.url, frames)[1] == {
            "type": "error",
            "data": {
                "message": "KeyError: 'k'",
                "code": "EXECUTION_ERROR",
                "error_type": "KeyError",
                "location": f"{where}:{line} in step",
            },
        }


def test_the_in_process_client_validates_against_the_env_own_action_class() -> None:
    from agile_llmenvs.errors import EnvProtocolError
    from agile_llmenvs.transport import InProcessEnvClient

    with InProcessEnvClient(GuessEnvironment(), action_field="guess") as client:
        assert client.action_cls is GuessAction  # read off GuessEnvironment.step
        assert client.reset().observation == {
            "text": "Guess a number from 1 to 10.",
            "attempts_left": 3,
        }
        reply = client.step("7")
        assert (reply.observation, reply.reward, reply.done) == (
            {"text": "Right!", "attempts_left": 2},
            1.0,
            True,
        )
    with InProcessEnvClient(GuessEnvironment()) as client:  # our text field: refused
        client.reset()
        with pytest.raises(EnvProtocolError, match="guess\n  Field required"):
            client.step("7")
