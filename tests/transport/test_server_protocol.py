"""OpenEnvServer on the wire: a raw WebSocket client sends good and bad frames."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.error
import urllib.request
from functools import partial
from typing import Any

import pytest
from echo_envs import BrokenFactoryEnv, EchoEnv
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from agile_llmenvs.transport import OpenEnvServer, OpenEnvWrapper, ServerSettings, TextAction


def ws_connect(server: OpenEnvServer, path: str = "/ws", **kwargs: Any) -> ClientConnection:
    return connect(server.url.replace("http", "ws") + path, compression=None, **kwargs)


def ask(ws: ClientConnection, message: dict[str, Any] | str | bytes) -> dict[str, Any]:
    ws.send(message if isinstance(message, str | bytes) else json.dumps(message))
    return json.loads(ws.recv(timeout=5))


def test_a_session_is_one_env_from_reset_to_close() -> None:
    built: list[EchoEnv] = []

    def make_env() -> EchoEnv:
        built.append(EchoEnv())
        return built[-1]

    with OpenEnvServer(make_env=make_env, max_concurrent_envs=2) as server:
        with ws_connect(server) as ws:
            reply = ask(ws, {"type": "reset", "data": {"seed": 1, "unknown_kwarg": 2}})
            assert reply["type"] == "observation"
            assert reply["data"]["observation"]["prompt"] == "start seed=1"
            assert reply["data"]["reward"] is None
            assert reply["data"]["done"] is False
            assert ask(ws, {"type": "step", "data": {"message": "hi"}})["data"]["reward"] == 1.0
            assert ask(ws, {"type": "state"}) == {
                "type": "state",
                "data": {
                    "episode_id": None,
                    "step_count": 1,
                    "dataset_size": 3,
                    "tools": None,
                    "max_turns": 5,
                    "rubric_components": None,
                },
            }
            ws.send(json.dumps({"type": "close"}))
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=5)
            assert closed.value.rcvd is not None
            assert closed.value.rcvd.code == 1000
        deadline = time.monotonic() + 5
        while server.active_sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.active_sessions == 0
    assert len(built) == 1
    assert built[0].closed  # the session's env is closed with the session


@pytest.mark.parametrize(
    ("frame", "code", "message"),
    [
        ("{not json", "INVALID_JSON", "Invalid JSON: "),
        ('{"type": "teleport"}', "UNKNOWN_TYPE", "Unknown message type: teleport"),
        ('["reset"]', "UNKNOWN_TYPE", "Unknown message type: None"),
        ('{"type": "state", "id": 7}', "VALIDATION_ERROR", "Invalid message"),
        ('{"type": "step"}', "VALIDATION_ERROR", "Invalid message"),
        # OpenEnv's words: the field and the reason travel in data["errors"]
        ('{"type": "step", "data": {"text": "x"}}', "VALIDATION_ERROR", "Invalid message"),
        (b"\x00\x01", "VALIDATION_ERROR", "Binary frames are not supported"),
        ("x" * 2000, "MESSAGE_TOO_LARGE", "Message of 2000 bytes exceeds the server's limit"),
    ],
)
def test_bad_frames_get_error_replies_and_the_session_goes_on(
    frame: str | bytes, code: str, message: str
) -> None:
    settings = ServerSettings(max_message_bytes=1000)
    server = OpenEnvServer(make_env=EchoEnv, max_concurrent_envs=2, settings=settings)
    with server, ws_connect(server) as ws, ws_connect(server) as other:
        ask(ws, {"type": "reset"})
        ask(other, {"type": "reset"})
        reply = ask(ws, frame)
        assert reply["type"] == "error"
        assert reply["data"]["code"] == code
        assert message in reply["data"]["message"]
        assert (
            ask(ws, {"type": "step", "data": {"message": "ok"}})["data"]["observation"]["prompt"]
            == "1:ok"
        )
        assert (
            ask(other, {"type": "step", "data": {"message": "fine"}})["data"]["observation"][
                "prompt"
            ]
            == "1:fine"
        )


def test_frames_far_over_the_limit_close_the_connection() -> None:
    settings = ServerSettings(max_message_bytes=1000)
    with OpenEnvServer(make_env=EchoEnv, settings=settings) as server, ws_connect(server) as ws:
        ws.send("x" * 5000)
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == 1009


def test_an_env_exception_is_an_execution_error_and_the_session_stays_open() -> None:
    with OpenEnvServer(make_env=EchoEnv) as server, ws_connect(server) as ws:
        ask(ws, {"type": "reset"})
        reply = ask(ws, {"type": "step", "data": {"message": "boom"}})
        location = reply["data"].pop("location")  # the env's file and line: see test_clients
        assert re.fullmatch(r"(\S+/)?echo_envs\.py:\d+ in step", location)
        assert reply == {
            "type": "error",
            "data": {
                "message": "ValueError: the env exploded",
                "code": "EXECUTION_ERROR",
                "error_type": "ValueError",
            },
        }
        assert ask(ws, {"type": "step", "data": {"message": "x"}})["type"] == "observation"


def test_capacity_is_reported_unprompted_then_the_socket_closes() -> None:
    with OpenEnvServer(make_env=EchoEnv, max_concurrent_envs=1) as server:
        with ws_connect(server) as first:
            ask(first, {"type": "reset"})
            with ws_connect(server) as second:
                refusal = json.loads(second.recv(timeout=5))
                assert refusal == {
                    "type": "error",
                    "data": {
                        "message": "Server at capacity (1/1 sessions)",
                        "code": "CAPACITY_REACHED",
                        "active_sessions": 1,
                        "max_sessions": 1,
                    },
                }
                with pytest.raises(ConnectionClosed):
                    second.recv(timeout=5)
        time.sleep(0.2)
        with ws_connect(server) as third:  # the slot is free again
            assert ask(third, {"type": "reset"})["type"] == "observation"


def test_a_factory_failure_is_reported() -> None:
    with OpenEnvServer(make_env=BrokenFactoryEnv) as server, ws_connect(server) as ws:
        ws.send(json.dumps({"type": "reset", "data": {}}))  # envs are built at the first message
        reply = json.loads(ws.recv(timeout=5))
        assert reply["data"]["code"] == "FACTORY_ERROR"
        assert reply["data"]["message"] == "RuntimeError: cannot build this env"


def test_token_is_required_when_set() -> None:
    with OpenEnvServer(make_env=EchoEnv, token="s3cret") as server:
        with pytest.raises(InvalidStatus) as refused:
            ws_connect(server)
        assert refused.value.response.status_code == 403
        with pytest.raises(InvalidStatus):
            ws_connect(server, additional_headers={"Authorization": "Bearer wrong"})
        with ws_connect(server, additional_headers={"Authorization": "Bearer s3cret"}) as ws:
            assert ask(ws, {"type": "reset"})["type"] == "observation"
        with ws_connect(server, path="/ws?token=s3cret") as ws:
            assert ask(ws, {"type": "reset"})["type"] == "observation"


def test_http_health_metadata_sessions_and_unknown_paths() -> None:
    with OpenEnvServer(make_env=EchoEnv, env_name="echo", max_concurrent_envs=3) as server:
        with urllib.request.urlopen(server.url + "/health", timeout=5) as response:
            assert json.loads(response.read()) == {"status": "healthy"}
        with urllib.request.urlopen(server.url + "/metadata", timeout=5) as response:
            metadata = json.loads(response.read())  # OpenEnv's EnvironmentMetadata
        assert metadata == {
            "name": "echo",
            "description": (EchoEnv.__doc__ or "").strip()[:200],
            "readme_content": None,
            "version": None,
            "author": None,
            "documentation_url": None,
        }
        with urllib.request.urlopen(server.url + "/sessions", timeout=5) as response:
            assert json.loads(response.read()) == {
                "name": "echo",
                "active_sessions": 0,
                "max_sessions": 3,
            }
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(server.url + "/nowhere", timeout=5)
        assert missing.value.code == 404


def test_idle_sessions_are_closed() -> None:
    settings = ServerSettings(session_idle_timeout_s=0.3)
    with OpenEnvServer(make_env=EchoEnv, settings=settings) as server, ws_connect(server) as ws:
        ask(ws, {"type": "reset"})
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
        assert closed.value.rcvd is not None
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1001, "session idle timeout")


def test_a_call_longer_than_the_idle_timeout_is_not_cut_off() -> None:
    """Idle time counts from the last reply: a slow step is not idleness."""
    settings = ServerSettings(session_idle_timeout_s=0.3)
    with OpenEnvServer(make_env=EchoEnv, settings=settings) as server, ws_connect(server) as ws:
        ask(ws, {"type": "reset"})
        reply = ask(ws, {"type": "step", "data": {"message": "sleep:0.8"}})
        replied = time.monotonic()
        assert reply["data"]["observation"]["prompt"] == "1:sleep:0.8"
        assert ask(ws, {"type": "step", "data": {"message": "on"}})["data"]["reward"] == 2.0
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
        assert time.monotonic() - replied >= 0.3
        assert closed.value.rcvd is not None
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1001, "session idle timeout")


def test_half_open_peers_are_reaped_and_capacity_recovers() -> None:
    """A client that vanishes without closing (its socket open, answering nothing) is dropped
    by the keep-alive ping, and its slot serves the next client."""
    settings = ServerSettings(ws_ping_interval_s=0.2, ws_ping_timeout_s=0.3)
    with OpenEnvServer(make_env=EchoEnv, max_concurrent_envs=1, settings=settings) as server:
        silent = socket.create_connection(("127.0.0.1", server.port))
        silent.sendall(
            b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        assert silent.recv(4096).startswith(b"HTTP/1.1 101")
        payload, mask = b'{"type": "reset"}', b"\x01\x02\x03\x04"  # a slot comes with an env
        masked = bytes(byte ^ mask[i % 4] for i, byte in enumerate(payload))
        silent.sendall(bytes([0x81, 0x80 | len(payload)]) + mask + masked)  # then it goes silent
        time.sleep(0.1)
        assert server.active_sessions == 1
        deadline = time.monotonic() + 5
        while server.active_sessions and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.active_sessions == 0
        with ws_connect(server) as ws:
            assert ask(ws, {"type": "reset"})["type"] == "observation"
        silent.close()


def test_shared_env_serves_one_session_at_a_time_and_is_not_closed() -> None:
    env = EchoEnv()
    with OpenEnvServer(env) as server:
        for _ in range(2):
            with ws_connect(server) as ws:
                ask(ws, {"type": "reset"})
                ask(ws, {"type": "step", "data": {"message": "x"}})
    assert env.closed is False


def test_constructor_errors() -> None:
    with pytest.raises(ValueError, match="exactly one of `env` or `make_env`"):
        OpenEnvServer()
    with pytest.raises(ValueError, match="exactly one of `env` or `make_env`"):
        OpenEnvServer(EchoEnv(), make_env=EchoEnv)
    with pytest.raises(ValueError, match="max_concurrent_envs=4 needs `make_env`"):
        OpenEnvServer(EchoEnv(), max_concurrent_envs=4)
    with OpenEnvServer(make_env=EchoEnv) as server:
        from agile_llmenvs.errors import AgileLLMEnvsError

        with pytest.raises(
            AgileLLMEnvsError, match=f"cannot bind the env server to 127.0.0.1:{server.port}"
        ):
            OpenEnvServer(make_env=EchoEnv, port=server.port)


def test_url_uses_the_advertised_host() -> None:
    with OpenEnvServer(make_env=EchoEnv, advertise_host="10.1.2.3") as server:
        assert server.url == f"http://10.1.2.3:{server.port}"


class _ShoutingWrapper(OpenEnvWrapper):
    """A wrapper subclass that overrides ``step``: the server must call the override."""

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> Any:
        return super().step(TextAction(message=action.message.upper()))


def test_a_wrapper_subclass_overriding_step_is_called_for_every_step() -> None:
    make_env = partial(_ShoutingWrapper, EchoEnv(), owns_inner=False)
    with OpenEnvServer(make_env=make_env) as server, ws_connect(server) as ws:
        ask(ws, {"type": "reset"})
        for k in range(40):  # past the warm-up that moves fast env classes inline
            reply = ask(ws, {"type": "step", "data": {"message": f"hi{k}"}})
            assert reply["data"]["observation"]["prompt"] == f"{k + 1}:HI{k}"
