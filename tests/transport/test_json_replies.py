"""Replies are JSON: a non-finite number from an env is a typed error, never a bare ``NaN``."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.sync.client import connect
from websockets.sync.server import Server, ServerConnection, serve

from agile_llmenvs.errors import EnvExecutionError, EnvProtocolError
from agile_llmenvs.transport import (
    OpenEnvServer,
    OpenEnvWrapper,
    TextAction,
    TextObservation,
    TextState,
)
from agile_llmenvs.transport.protocol import WireError, error_frame, state_frame, strict_json_loads
from agile_llmenvs.transport.remote import RemoteEnvClient


class RewardEnv:
    """Each step's reward is the action parsed as a float (``"nan"``, ``"inf"``, ``"2"``)."""

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        return "go", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return f"got {action}", float(action), False, False, {"seen": action}

    def close(self) -> None:
        pass


class _OverridingWrapper(OpenEnvWrapper):
    """Overrides ``step``, so the server takes the general observation path."""

    def step(
        self, action: TextAction, timeout_s: float | None = None, **kwargs: Any
    ) -> TextObservation:
        return super().step(action, timeout_s, **kwargs)


def _finite_message(url: str, field: str, name: str) -> str:
    return (
        f"{url}: the env's {field} is {name}: replies are JSON, which has no {name}; "
        "return a finite number [code EXECUTION_ERROR]"
    )


@pytest.mark.parametrize("make_env", [RewardEnv, lambda: _OverridingWrapper(RewardEnv())])
def test_a_nan_reward_is_an_execution_error_and_the_session_goes_on(make_env: Any) -> None:
    with OpenEnvServer(make_env=make_env, max_concurrent_envs=2) as server:
        client = RemoteEnvClient(server.url, timeout_s=10)
        other = RemoteEnvClient(server.url, timeout_s=10)
        try:
            client.reset()
            other.reset()
            for action, name in [("nan", "NaN"), ("inf", "Infinity"), ("-inf", "-Infinity")]:
                with pytest.raises(EnvExecutionError) as raised:
                    client.step(action)
                assert str(raised.value) == _finite_message(client.url, "reward", name)
                assert raised.value.code == "EXECUTION_ERROR"
            reply = client.step("2.5")  # the same session goes on
            assert (reply.observation["prompt"], reply.reward) == ("got 2.5", 2.5)
            assert other.step("1").reward == 1.0  # and so does every other one
        finally:
            client.close()
            other.close()


def test_a_bare_nan_in_a_request_is_invalid_json() -> None:
    server = OpenEnvServer(make_env=RewardEnv)
    with server, connect(server.url.replace("http", "ws") + "/ws", compression=None) as ws:
        ws.send('{"type": "reset", "data": {"seed": NaN}}')
        assert json.loads(ws.recv(timeout=5)) == {
            "type": "error",
            "data": {"message": "Invalid JSON: NaN is not JSON", "code": "INVALID_JSON"},
        }
        ws.send(json.dumps({"type": "reset"}))
        assert json.loads(ws.recv(timeout=5))["type"] == "observation"


@pytest.fixture
def nan_server() -> Iterator[str]:
    """A WebSocket server whose every reply holds a bare ``NaN`` (what a buggy server sends)."""

    def answer(ws: ServerConnection) -> None:
        for _ in ws:
            ws.send('{"type": "observation", "data": {"observation": {}, "reward": NaN}}')

    server: Server = serve(answer, "127.0.0.1", 0, compression=None)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.socket.getsockname()[1]}"
    finally:
        server.shutdown()
        thread.join(5)


def test_the_client_refuses_a_reply_holding_a_bare_nan(nan_server: str) -> None:
    client = RemoteEnvClient(nan_server, timeout_s=5)
    try:
        with pytest.raises(EnvProtocolError) as raised:
            client.reset()
        assert str(raised.value) == f"{client.url}: the server's reply is not JSON: NaN is not JSON"
    finally:
        client.close()


def test_frames_are_strict_json() -> None:
    with pytest.raises(ValueError, match=r"^Infinity is not JSON$"):
        strict_json_loads(b'{"x": Infinity}')
    assert strict_json_loads('{"x": 1.5}') == {"x": 1.5}
    # an error frame never carries a non-finite extra: it is left out, the reply stays JSON
    assert json.loads(error_frame("EXECUTION_ERROR", "m", score=float("nan"))) == {
        "type": "error",
        "data": {"message": "m", "code": "EXECUTION_ERROR"},
    }


def test_a_nan_in_the_state_names_its_field() -> None:
    state = TextState(step_count=1, rubric_components={"exact": 1.0, "style": float("nan")})
    with pytest.raises(WireError) as raised:
        state_frame(state)
    assert str(raised.value) == (
        "the env's state.rubric_components.style is NaN: replies are JSON, which has no NaN; "
        "return a finite number"
    )
    assert raised.value.code == "EXECUTION_ERROR"
