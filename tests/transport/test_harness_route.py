"""OpenEnv 0.10's production ``/harness`` WebSocket on both fronts (``agile-llmenvs serve``'s
server and the ASGI app under uvicorn): the same frames, sent by real WebSocket clients, get
the same frames back as from OpenEnv's own ``create_app`` serving the same harness env.

The harness is a scripted in-process adapter (a real one, such as Claude Code, needs its
process and an API key); what it does on a turn is chosen by the message's content.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from openenv_native import EchoAction, EchoEnvironment, EchoObservation
from serving import UvicornApp
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

pytest.importorskip("uvicorn")
http_server = pytest.importorskip("openenv.core.env_server.http_server")
harness = pytest.importorskip("openenv.core.harness")

from openenv.core.harness import (  # noqa: E402
    AgenticHarnessAdapter,
    HarnessConfig,
    HarnessEnvironment,
    HarnessEvent,
    HarnessEventType,
)

from agile_llmenvs.transport import OpenEnvServer, ServerSettings, create_asgi_app  # noqa: E402
from agile_llmenvs.transport._openenv import Observation  # noqa: E402

TURN_TIMEOUT_S = 1.0
SECRET = "sk-live-do-not-leak"


def _event(kind: HarnessEventType, t: float, **data: Any) -> HarnessEvent:
    return HarnessEvent(type=kind, timestamp=t, data=data)


class ScriptedAdapter(AgenticHarnessAdapter):
    """A harness in this process: each message content names what its turn does."""

    BUILTIN_TOOL_NAMES = frozenset({"bash"})

    def __init__(self) -> None:
        super().__init__(
            HarnessConfig(name="scripted", command=["scripted"], session_timeout_s=TURN_TIMEOUT_S)
        )
        self.alive = False

    async def start(self, working_directory: str) -> None:
        self.alive = True

    async def stop(self) -> None:
        self.alive = False

    async def inject_tools(self, tools: list[Any], bridge_url: str | None = None) -> None:
        pass

    async def is_alive(self) -> bool:
        return self.alive

    async def send_message_streaming(self, message: str) -> AsyncIterator[HarnessEvent]:
        yield _event(HarnessEventType.LLM_CHUNK, 1.0, content=message[:4], index=0)
        if message == "raise":
            raise RuntimeError(f"upstream said 401 for key {SECRET}")
        if message == "hang":
            await asyncio.sleep(30)
        yield _event(HarnessEventType.TOOL_CALL, 2.0, tool_name="bash", arguments={"cmd": "ls"})
        yield _event(
            HarnessEventType.TOOL_RESULT, 3.0, tool_name="bash", result="a.txt", error=None
        )
        yield _event(HarnessEventType.TEXT_OUTPUT, 4.0, text=f"did {message}")
        if message == "truncate":
            return
        if message == "die":
            self.alive = False
        yield _event(HarnessEventType.TURN_COMPLETE, 5.0, response=f"did {message}", done=False)


class ScriptedHarnessEnvironment(HarnessEnvironment):
    """OpenEnv's harness env over a fresh :class:`ScriptedAdapter` (one per env)."""

    def __init__(self) -> None:
        super().__init__(ScriptedAdapter())


def message(content: str) -> str:
    return json.dumps({"type": "message", "content": content})


#: name -> the client frames of one session
SESSIONS: dict[str, list[str | bytes]] = {
    "one turn": [message("hello")],
    "two turns": [message("hello"), message("again")],
    "invalid json, then a turn": ["{not json", message("hello")],
    "invalid messages, then a turn": [
        json.dumps({"type": "message"}),
        json.dumps({"type": "chat", "content": "x"}),
        json.dumps({"type": "message", "content": "x", "extra": 1}),
        json.dumps(["a list"]),
        message("hello"),
    ],
    "a turn that times out": [message("hang"), message("never read")],
    "an adapter that raises": [message("raise")],
    "a harness that died": [message("die"), message("hello")],
    "a stream without turn_complete": [message("truncate")],
    "a binary frame": [b"\x00\x01"],
}

_TERMINAL = {"turn_complete", "protocol_error", "error"}


def _normalised(frame: str) -> Any:
    """The frame as data, its server-made session id and error-event time replaced."""
    data = json.loads(frame)
    if data["type"] == "session_started":
        uuid.UUID(data["data"]["session_id"])
        data["data"]["session_id"] = "<session>"
    if data["type"] == "error" and "timestamp" in data:
        assert abs(data["timestamp"] - time.time()) < 60
        data["timestamp"] = "<now>"
    return data


def _read_turn(ws: ClientConnection, transcript: list[Any]) -> bool:
    """Read frames up to the turn's last; False once the server closed the session."""
    while True:
        try:
            frame = ws.recv(timeout=15)
        except ConnectionClosed as closed:
            transcript.append(("closed", closed.rcvd.code if closed.rcvd else None))
            return False
        transcript.append(_normalised(str(frame)))
        if transcript[-1]["type"] in _TERMINAL - {"error"}:
            return True  # an error ends the session: read on to its close


def transcript(url: str, frames: list[str | bytes], path: str = "/harness") -> list[Any]:
    """What one session of ``frames`` gets back: each frame (normalised), and the close."""
    got: list[Any] = []
    with connect(url.replace("http://", "ws://") + path) as ws:
        got.append(_normalised(str(ws.recv(timeout=15))))
        for frame in frames:
            ws.send(frame)
            if not _read_turn(ws, got):
                return got
        ws.close()
    got.append(("closed by the client", None))
    return got


def create_app_url(make_env: Callable[[], Any] = ScriptedHarnessEnvironment, **kwargs: Any):
    app = http_server.create_app(
        make_env,
        EchoAction,
        Observation,
        env_name="scripted",
        max_concurrent_envs=1,
        mode=kwargs.pop("mode", "production"),
        **kwargs,
    )
    return UvicornApp(app)


@contextmanager
def ours(front: str, make_env: Callable[[], Any], **kwargs: Any) -> Iterator[str]:
    arguments: dict[str, Any] = {
        "make_env": make_env,
        "action_cls": EchoAction,
        "observation_cls": Observation,
        "env_name": "scripted",
        "max_concurrent_envs": 1,
        "mode": "production",
        **kwargs,
    }
    if front == "serve":
        with OpenEnvServer(**arguments) as server:
            yield server.url
        return
    with UvicornApp(create_asgi_app(**arguments)) as served:
        yield served.url


@pytest.fixture(scope="module")
def theirs() -> Iterator[str]:
    """OpenEnv's ``create_app`` serving the harness env, the reference."""
    with create_app_url() as served:
        yield served.url


@pytest.fixture(scope="module", params=["serve", "uvicorn"])
def front(request: pytest.FixtureRequest) -> Iterator[str]:
    with ours(request.param, ScriptedHarnessEnvironment) as url:
        yield url


STARTED = {"type": "session_started", "data": {"session_id": "<session>", "harness": "scripted"}}


def _turn(content: str, *, complete: bool = True) -> list[Any]:
    frames: list[Any] = [
        {"type": "llm_chunk", "timestamp": 1.0, "data": {"content": content[:4], "index": 0}},
        {
            "type": "tool_call",
            "timestamp": 2.0,
            "data": {"tool_name": "bash", "arguments": {"cmd": "ls"}},
        },
        {
            "type": "tool_result",
            "timestamp": 3.0,
            "data": {"tool_name": "bash", "result": "a.txt", "error": None},
        },
        {"type": "text_output", "timestamp": 4.0, "data": {"text": f"did {content}"}},
    ]
    if complete:
        frames.append(
            {
                "type": "turn_complete",
                "timestamp": 5.0,
                "data": {"response": f"did {content}", "done": False},
            }
        )
    return frames


def _ended(why: str) -> list[Any]:
    error = {"message": why, "recoverable": False}
    return [{"type": "error", "timestamp": "<now>", "data": error}, ("closed", 1000)]


def _protocol_error(code: str, start: str) -> Any:
    return {"type": "protocol_error", "data": {"code": code, "message": start}}


def _startswith(got: Any, want: Any) -> bool:
    """``got`` is ``want``, where a protocol error's message need only start as ``want``'s."""
    if isinstance(want, dict) and want.get("type") == "protocol_error":
        return got["data"]["code"] == want["data"]["code"] and got["data"]["message"].startswith(
            want["data"]["message"]
        )
    return bool(got == want)


#: name -> what the session gets back (protocol errors: the message's start)
EXPECTED: dict[str, list[Any]] = {
    "one turn": [STARTED, *_turn("hello"), ("closed by the client", None)],
    "two turns": [STARTED, *_turn("hello"), *_turn("again"), ("closed by the client", None)],
    "invalid json, then a turn": [
        STARTED,
        _protocol_error("INVALID_JSON", "Invalid JSON: Expecting property name"),
        *_turn("hello"),
        ("closed by the client", None),
    ],
    "invalid messages, then a turn": [
        STARTED,
        _protocol_error("VALIDATION_ERROR", "Invalid message: 1 validation error"),
        _protocol_error("VALIDATION_ERROR", "Invalid message: 1 validation error"),
        *_turn("x"),  # OpenEnv's message model ignores extra fields
        _protocol_error("VALIDATION_ERROR", "Invalid message: "),
        *_turn("hello"),
        ("closed by the client", None),
    ],
    "a turn that times out": [
        STARTED,
        _turn("hang")[0],
        *_ended(f"harness turn exceeded {TURN_TIMEOUT_S} seconds"),
    ],
    "an adapter that raises": [STARTED, _turn("raise")[0], *_ended("harness turn failed")],
    "a harness that died": [
        STARTED,
        *_turn("die"),
        *_ended("harness process is not running"),
    ],
    "a stream without turn_complete": [
        STARTED,
        *_turn("truncate", complete=False),
        *_ended("harness event stream ended without a TURN_COMPLETE event"),
    ],
    "a binary frame": [
        STARTED,
        {"type": "error", "data": {"message": "harness session failed", "code": "SESSION_ERROR"}},
        ("closed", 1000),
    ],
}


@pytest.mark.parametrize("session", list(SESSIONS))
def test_harness_sessions_answer_as_create_app_does(theirs: str, front: str, session: str) -> None:
    want = transcript(theirs, SESSIONS[session])
    expected = EXPECTED[session]
    assert len(want) == len(expected), want
    assert all(_startswith(g, e) for g, e in zip(want, expected, strict=True)), want
    assert transcript(front, SESSIONS[session]) == want
    assert SECRET not in json.dumps(want, default=str)


def test_a_full_server_and_a_failing_factory_answer_as_create_app_does(theirs: str) -> None:
    def busy(url: str) -> list[Any]:
        with connect(url.replace("http://", "ws://") + "/harness") as holder:
            assert _normalised(str(holder.recv(timeout=15))) == STARTED
            got: list[Any] = []
            with connect(url.replace("http://", "ws://") + "/harness") as refused:
                _read_turn(refused, got)
            return got

    full = {
        "type": "error",
        "data": {
            "message": "Server at capacity: 1/1 sessions active. Cannot accept new connections.",
            "code": "CAPACITY_REACHED",
        },
    }
    assert busy(theirs) == [full, ("closed", 1000)]

    def first_only() -> Callable[[], Any]:
        built: list[int] = []

        def scripted_once() -> ScriptedHarnessEnvironment:
            built.append(1)
            if len(built) > 1:  # the start-up look succeeds, the session's build fails
                raise RuntimeError(f"no credentials: {SECRET}")
            return ScriptedHarnessEnvironment()

        return scripted_once

    failed = {
        "type": "error",
        "data": {
            "message": "Environment factory 'scripted_once' failed to create instance.",
            "code": "FACTORY_ERROR",
        },
    }

    def refused(url: str) -> list[Any]:
        got: list[Any] = []
        with connect(url.replace("http://", "ws://") + "/harness") as ws:
            _read_turn(ws, got)
        return got

    with create_app_url(first_only()) as reference:
        assert refused(reference.url) == [failed, ("closed", 1000)]
    for name in ("serve", "uvicorn"):
        with ours(name, ScriptedHarnessEnvironment) as url:
            assert busy(url) == [full, ("closed", 1000)], name
        with ours(name, first_only()) as url:
            assert refused(url) == [failed, ("closed", 1000)], name
    assert SECRET not in json.dumps(failed)


def _handshake_status(url: str, path: str = "/harness") -> int:
    with pytest.raises(InvalidStatus) as refused:
        connect(url.replace("http://", "ws://") + path)
    return int(refused.value.response.status_code)


@pytest.mark.parametrize("front_name", ["serve", "uvicorn"])
def test_harness_stays_unserved_where_create_app_does_not_serve_it(front_name: str) -> None:
    """A non-harness env in production mode, and a harness env in simulation mode."""
    cases: list[tuple[Callable[[], Any], str]] = [
        (EchoEnvironment, "production"),
        (ScriptedHarnessEnvironment, "simulation"),
    ]
    for make_env, mode in cases:
        with create_app_url(make_env, mode=mode) as reference:
            want = _handshake_status(reference.url)
        assert want == 403, (make_env, mode)
        with ours(front_name, make_env, mode=mode, observation_cls=EchoObservation) as url:
            assert _handshake_status(url) == want, (make_env, mode)


@pytest.mark.parametrize("front_name", ["serve", "uvicorn"])
def test_harness_takes_the_token_and_closes_an_idle_session(front_name: str) -> None:
    settings = ServerSettings(session_idle_timeout_s=0.5)
    with ours(front_name, ScriptedHarnessEnvironment, token="s3cret", settings=settings) as url:
        assert _handshake_status(url) == 403
        with connect(url.replace("http://", "ws://") + "/harness?token=s3cret") as ws:
            assert _normalised(str(ws.recv(timeout=15))) == STARTED
            got: list[Any] = []
            ws.send(message("hello"))
            assert _read_turn(ws, got)
            assert got == _turn("hello")
            assert not _read_turn(ws, got)  # nothing sent for 0.5 s: closed, its slot freed
            assert got[-1] == ("closed", 1001)
        sessions = f"{url}/sessions?token=s3cret"
        deadline = time.monotonic() + 10
        while httpx.get(sessions).json()["active_sessions"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.get(sessions).json()["active_sessions"] == 0
        with connect(url.replace("http://", "ws://") + "/harness?token=s3cret") as again:
            assert _normalised(str(again.recv(timeout=15))) == STARTED
