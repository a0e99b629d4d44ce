"""A server that no env can stop: BaseExceptions, hung and slow steps, idle handshakes."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from typing import Any

import pytest
from echo_envs import EchoEnv, HostileEnv
from serving import ServedProcess
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from agile_llmenvs.transport import OpenEnvServer, RemoteEnvClient, ServerSettings
from agile_llmenvs.transport.calls import WARMUP_CALLS
from agile_llmenvs.transport.server import DEFAULT_MAX_SESSIONS


def ws_connect(url: str) -> ClientConnection:
    return connect(url.replace("http", "ws") + "/ws", compression=None)


def ask(ws: ClientConnection, message: dict[str, Any], timeout: float = 10) -> dict[str, Any]:
    ws.send(json.dumps(message))
    return json.loads(ws.recv(timeout=timeout))


def step(ws: ClientConnection, text: str) -> dict[str, Any]:
    return ask(ws, {"type": "step", "data": {"message": text}})


def health(url: str) -> int:
    with urllib.request.urlopen(url + "/health", timeout=5) as response:
        return int(response.status)


def closed_code(ws: ClientConnection) -> int | None:
    with pytest.raises(ConnectionClosed) as closed:
        ws.recv(timeout=5)
    return None if closed.value.rcvd is None else closed.value.rcvd.code


@pytest.mark.parametrize(
    ("action", "raised"), [("exit", "SystemExit"), ("interrupt", "KeyboardInterrupt")]
)
def test_an_env_raising_system_exit_ends_only_its_own_session(action: str, raised: str) -> None:
    with OpenEnvServer(make_env=HostileEnv, max_concurrent_envs=4) as server:
        with ws_connect(server.url) as other, ws_connect(server.url) as hostile:
            ask(other, {"type": "reset"})
            ask(hostile, {"type": "reset"})
            reply = step(hostile, action)
            assert reply["type"] == "error"
            assert reply["data"]["code"] == "EXECUTION_ERROR"
            assert reply["data"]["error_type"] == raised
            assert closed_code(hostile) == 1011  # its env is discarded
            assert step(other, "still here")["data"]["observation"]["prompt"] == "1:still here"
        assert server.serving
        assert health(server.url) == 200
        with ws_connect(server.url) as fresh:  # new sessions are still served
            assert ask(fresh, {"type": "reset"})["type"] == "observation"


def test_agile_llmenvs_serve_survives_system_exit_and_exits_zero_on_sigterm() -> None:
    served = ServedProcess("echo_envs:HostileEnv", "--port", "0", "--max-concurrent-envs", "2")
    try:
        with ws_connect(served.url) as hostile:
            ask(hostile, {"type": "reset"})
            assert step(hostile, "exit")["data"]["error_type"] == "SystemExit"
        with ws_connect(served.url) as fresh:
            assert step(fresh, "hi")["data"]["reward"] == 1.0
        assert health(served.url) == 200
        assert served.proc.poll() is None
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(10) == 0
    finally:
        if served.proc.poll() is None:
            served.kill()


def test_a_hung_step_is_bounded_and_does_not_freeze_the_server() -> None:
    settings = ServerSettings(env_step_timeout_s=0.5)
    with (
        OpenEnvServer(make_env=EchoEnv, max_concurrent_envs=4, settings=settings) as server,
        ws_connect(server.url) as hung,
        ws_connect(server.url) as other,
    ):
        ask(hung, {"type": "reset"})
        ask(other, {"type": "reset"})
        hung.send(json.dumps({"type": "step", "data": {"message": "sleep:20"}}))
        time.sleep(0.1)
        start = time.monotonic()
        # a server frozen by the hung step would answer in ~20 s (the bounds leave room for
        # a loaded machine's stalls)
        assert health(server.url) == 200
        assert step(other, "hi")["data"]["reward"] == 1.0
        assert time.monotonic() - start < 5
        reply = json.loads(hung.recv(timeout=10))
        assert time.monotonic() - start < 8  # ~0.4 s left of its 0.5 s bound, not 20 s
        assert reply["data"]["code"] == "EXECUTION_ERROR"
        assert reply["data"]["message"] == (
            "EnvCallTimeout: the env's step took longer than env_step_timeout_s=0.5 s; "
            "the session is closed and its env discarded"
        )
        assert closed_code(hung) == 1011


def test_a_slow_step_of_a_proven_fast_env_delays_no_other_session() -> None:
    """The env class is proven fast (the server waits for its calls on the loop), then one
    call takes 1.5 s: another session's steps meanwhile stay within the bound."""
    with (
        OpenEnvServer(make_env=EchoEnv, max_concurrent_envs=4) as server,
        ws_connect(server.url) as slow,
        ws_connect(server.url) as other,
    ):
        ask(slow, {"type": "reset"})
        ask(other, {"type": "reset"})
        for _ in range(WARMUP_CALLS + 8):
            step(slow, "x")
        slow.send(json.dumps({"type": "step", "data": {"message": "sleep:1.5"}}))
        time.sleep(0.05)
        latencies = []
        for _ in range(10):
            start = time.monotonic()
            step(other, "y")
            latencies.append(time.monotonic() - start)
        # the stated bound: inline_wait_s (2 ms) per call of another session, plus the
        # server's own work; 0.25 s leaves room for a loaded CI machine
        assert max(latencies) < 0.25, latencies
        assert json.loads(slow.recv(timeout=5))["type"] == "observation"


def test_idle_handshakes_are_closed_and_build_no_env() -> None:
    built: list[EchoEnv] = []

    def make_env() -> EchoEnv:
        built.append(EchoEnv())
        return built[-1]

    settings = ServerSettings(first_message_timeout_s=0.3)
    with OpenEnvServer(make_env=make_env, max_concurrent_envs=2, settings=settings) as server:
        with ws_connect(server.url) as first, ws_connect(server.url) as second:
            assert server.active_sessions == 0  # a slot is taken with an env, at the first
            assert built == []  # message, not at the handshake
            assert closed_code(first) == 1008
            assert closed_code(second) == 1008
        with ws_connect(server.url) as ws:
            assert ask(ws, {"type": "reset"})["type"] == "observation"
        assert len(built) == 1


def test_the_default_capacity_is_bounded_and_an_empty_token_is_refused() -> None:
    with OpenEnvServer(make_env=EchoEnv) as server:
        assert server.host_sessions.pool.max_sessions == DEFAULT_MAX_SESSIONS == 256
    with OpenEnvServer(env=EchoEnv()) as shared:
        assert shared.host_sessions.pool.max_sessions == 1
    with pytest.raises(ValueError, match="token is empty: an empty token would accept every"):
        OpenEnvServer(make_env=EchoEnv, token="")
    with pytest.raises(ValueError, match="token is empty: it would send no credentials at all"):
        RemoteEnvClient("http://127.0.0.1:1", token="")


def test_settings_refuse_non_positive_bounds() -> None:
    with pytest.raises(ValueError, match="env_step_timeout_s must be > 0 or None, got 0"):
        ServerSettings(env_step_timeout_s=0)
    with pytest.raises(ValueError, match="inline_wait_s must be >= 0, got -1"):
        ServerSettings(inline_wait_s=-1)


def test_serving_is_false_once_closed() -> None:
    server = OpenEnvServer(make_env=EchoEnv)
    assert server.serving
    server.close()
    assert not server.serving
    assert not any(t.name == f"openenv-server-{server.port}" for t in threading.enumerate())
