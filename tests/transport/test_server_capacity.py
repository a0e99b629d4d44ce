"""Capacity no client or env can take away: hung calls, slow ``state``, env floods, squatters."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from echo_envs import EchoEnv
from openenv_native import EchoEnvironment
from serving import ServedProcess, wait_until
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from agile_llmenvs.errors import EnvCapacityError
from agile_llmenvs.transport import OpenEnvServer, ServerSettings
from agile_llmenvs.transport.remote import RemoteEnvClient

RELEASE = threading.Event()
SLOW_CALL_STARTED = threading.Event()


@pytest.fixture(autouse=True)
def release_hung_calls() -> Iterator[None]:
    """Hung env calls return once a test ends, so no thread outlives it for long."""
    RELEASE.clear()
    SLOW_CALL_STARTED.clear()
    yield
    RELEASE.set()


class HangingEnv(EchoEnv):
    """An :class:`EchoEnv` whose ``hang`` step blocks until the test ends."""

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if action == "hang":
            RELEASE.wait(60)
        return super().step(action)


class SlowStateEnvironment(EchoEnvironment):
    """An OpenEnv env whose ``state`` and ``get_metadata`` block until the test releases
    them (or 30 s pass)."""

    @property
    def state(self) -> Any:
        SLOW_CALL_STARTED.set()
        RELEASE.wait(30)
        return super().state

    def get_metadata(self) -> Any:
        SLOW_CALL_STARTED.set()
        RELEASE.wait(30)
        return super().get_metadata()


def ws_connect(url: str) -> ClientConnection:
    return connect(url.replace("http", "ws") + "/ws", compression=None)


def ask(ws: ClientConnection, message: dict[str, Any], timeout: float = 10) -> dict[str, Any]:
    ws.send(json.dumps(message))
    return json.loads(ws.recv(timeout=timeout))


def hang_one_step(server: OpenEnvServer) -> dict[str, Any]:
    """A session whose step hangs; the server's reply once the step's bound passes. Returns
    once the session's slot is free again: the server gives it back after closing the
    discarded env, a moment after the connection closes."""
    with ws_connect(server.url) as ws:
        ask(ws, {"type": "reset"})
        reply = ask(ws, {"type": "step", "data": {"message": "hang"}})
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=5)
    wait_until(
        lambda: server.active_sessions == 0, failure="the discarded session's slot was never freed"
    )
    return reply


def test_two_hung_steps_on_capacity_two_leave_new_sessions_served() -> None:
    settings = ServerSettings(env_step_timeout_s=0.3)
    with OpenEnvServer(make_env=HangingEnv, max_concurrent_envs=2, settings=settings) as server:
        for _ in range(2):
            reply = hang_one_step(server)
            assert reply["data"]["code"] == "EXECUTION_ERROR"
            assert "took longer than env_step_timeout_s=0.3 s" in reply["data"]["message"]
        for _ in range(2):  # each hung call's thread was replaced; the slots came back
            with ws_connect(server.url) as ws:
                assert ask(ws, {"type": "reset"})["type"] == "observation"
                assert ask(ws, {"type": "step", "data": {"message": "hi"}})["data"]["reward"] == 1
        assert httpx.get(server.url + "/health").status_code == 200


def test_a_server_past_its_bound_of_hung_calls_reports_unhealthy() -> None:
    settings = ServerSettings(env_step_timeout_s=0.3)
    with OpenEnvServer(make_env=HangingEnv, max_concurrent_envs=1, settings=settings) as server:
        hang_one_step(server)  # 1 thread, 2 hung calls replaced at most
        assert httpx.get(server.url + "/health").status_code == 200
        hang_one_step(server)
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503
        assert health.json() == {
            "status": "unhealthy",
            "reason": "2 env calls (step, step) outlived env_step_timeout_s and still hold "
            "their threads; past 2 hung calls the server replaces no more threads and can no "
            "longer build envs reliably: restart it",
        }
        RELEASE.set()  # the hung calls return: healthy again
        deadline = time.monotonic() + 5
        while httpx.get(server.url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)


def test_serve_exits_on_sigterm_while_an_env_step_hangs() -> None:
    served = ServedProcess("echo_envs:EchoEnv", "--port", "0")
    try:
        with ws_connect(served.url) as ws:
            ask(ws, {"type": "reset"})
            ws.send(json.dumps({"type": "step", "data": {"message": "sleep:120"}}))
            time.sleep(0.2)
            served.proc.send_signal(signal.SIGTERM)
            start = time.monotonic()
            assert served.proc.wait(15) == 0
            assert time.monotonic() - start < 10
    finally:
        if served.proc.poll() is None:
            served.kill()


@pytest.mark.parametrize("slow", ["ws state", "GET /state", "GET /metadata"])
def test_a_slow_state_or_metadata_call_leaves_the_event_loop_free(slow: str) -> None:
    with (
        OpenEnvServer(make_env=SlowStateEnvironment, max_concurrent_envs=4) as server,
        ws_connect(server.url) as ws,
    ):
        ask(ws, {"type": "reset"})
        answers: list[httpx.Response | dict[str, Any]] = []
        if slow == "ws state":
            ws.send(json.dumps({"type": "state"}))
            waiter = threading.Thread(target=lambda: answers.append(json.loads(ws.recv(10))))
        else:
            path = slow.split()[1]
            waiter = threading.Thread(
                target=lambda: answers.append(httpx.get(server.url + path, timeout=10))
            )
        waiter.start()
        assert SLOW_CALL_STARTED.wait(10)
        # the slow call runs until the test releases it, so only a free loop answers this
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert not answers
        RELEASE.set()
        waiter.join(10)
        answer = answers[0]
        if isinstance(answer, dict):
            assert answer["type"] == "state"
            assert answer["data"]["step_count"] == 0
        else:
            assert answer.status_code == 200


def test_a_state_call_past_its_bound_is_answered_with_an_error() -> None:
    settings = ServerSettings(env_step_timeout_s=0.3)
    with (
        OpenEnvServer(make_env=SlowStateEnvironment, settings=settings) as server,
        ws_connect(server.url) as ws,
    ):
        ask(ws, {"type": "reset"})
        start = time.monotonic()
        reply = ask(ws, {"type": "state"})
        assert time.monotonic() - start < 2
        assert reply["data"]["code"] == "EXECUTION_ERROR"
        assert reply["data"]["message"] == (
            "EnvCallTimeout: the env's state took longer than env_step_timeout_s=0.3 s; "
            "the session is closed and its env discarded"
        )
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=5)
        assert httpx.get(server.url + "/state").status_code == 500


class CountedEnv(EchoEnv):
    """An :class:`EchoEnv` that counts the instances alive at once; its reset takes 0.2 s."""

    lock = threading.Lock()
    alive = 0
    most_alive = 0

    def __init__(self) -> None:
        super().__init__()
        with CountedEnv.lock:
            CountedEnv.alive += 1
            CountedEnv.most_alive = max(CountedEnv.most_alive, CountedEnv.alive)

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        time.sleep(0.2)
        return super().reset(seed=seed, **task)

    def close(self) -> None:
        with CountedEnv.lock:
            CountedEnv.alive -= 1
        super().close()


def test_a_flood_of_http_resets_builds_no_more_envs_than_the_capacity() -> None:
    CountedEnv.alive = CountedEnv.most_alive = 0
    with OpenEnvServer(make_env=CountedEnv, max_concurrent_envs=2) as server:
        answers: list[httpx.Response] = []
        flood = [
            threading.Thread(
                target=lambda: answers.append(httpx.post(server.url + "/reset", json={}))
            )
            for _ in range(12)
        ]
        for thread in flood:
            thread.start()
        for thread in flood:
            thread.join(30)
        assert CountedEnv.most_alive <= 2
        statuses = sorted(answer.status_code for answer in answers)
        assert statuses.count(200) >= 2, statuses
        assert set(statuses) == {200, 503}, statuses
        refused = next(answer for answer in answers if answer.status_code == 503)
        assert refused.json() == {
            "detail": "Server at capacity (2/2 sessions): every slot holds a live env; retry "
            "later, or serve with a larger max_concurrent_envs"
        }
        assert server.active_sessions == 0
        with ws_connect(server.url) as ws:  # nothing leaked
            assert ask(ws, {"type": "reset"})["type"] == "observation"


def test_a_websocket_reset_during_an_http_reset_flood_is_answered_promptly() -> None:
    # issue #32: a WebSocket reset once waited 30.5 s (instead of 2 s) behind such a flood
    CountedEnv.alive = CountedEnv.most_alive = 0
    with OpenEnvServer(make_env=CountedEnv, max_concurrent_envs=2) as server:
        answers: list[httpx.Response] = []
        start = threading.Barrier(31)

        def post_reset() -> None:
            start.wait(10)
            answers.append(httpx.post(server.url + "/reset", json={}, timeout=30))

        flood = [threading.Thread(target=post_reset) for _ in range(30)]
        for thread in flood:
            thread.start()
        client = RemoteEnvClient(server.url, timeout_s=30)
        start.wait(10)
        began = time.monotonic()
        try:
            outcome = client.reset().observation["prompt"]
        except EnvCapacityError as exc:
            outcome = str(exc)
        waited = time.monotonic() - began
        for thread in flood:
            thread.join(30)
        client.close()
        assert waited < 5.0, f"the WebSocket reset waited {waited:.1f} s: {outcome}"
        # answered, or refused at once: the session's slot is taken by the flood's resets
        refused_ws = f"{client.url}: Server at capacity (2/2 sessions) [code CAPACITY_REACHED]"
        assert outcome in {"start seed=None", refused_ws}, outcome
        statuses = [answer.status_code for answer in answers]
        assert len(statuses) == 30
        assert set(statuses) <= {200, 503}, statuses
        assert statuses.count(503) >= 1, statuses  # capacity 2 cannot take 30 at once
        for refused in (answer for answer in answers if answer.status_code == 503):
            assert refused.json() == {"detail": CAPACITY}
        assert CountedEnv.most_alive <= 2


CAPACITY = (
    "Server at capacity (2/2 sessions): every slot holds a live env; retry later, or serve "
    "with a larger max_concurrent_envs"
)


def rpc(method: str, request_id: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": method, "params": {}, "id": request_id}


def test_mcp_sessions_that_no_connection_uses_are_reaped_to_make_room() -> None:
    settings = ServerSettings(mcp_session_idle_timeout_s=0.5)
    with OpenEnvServer(make_env=EchoEnv, max_concurrent_envs=2, settings=settings) as server:
        for request_id in (1, 2):
            made = httpx.post(server.url + "/mcp", json=rpc("openenv/session/create", request_id))
            assert "session_id" in made.json()["result"]
        with ws_connect(server.url) as refused:
            reply = json.loads(refused.recv(timeout=5))
            assert reply["data"]["code"] == "CAPACITY_REACHED"
        time.sleep(0.7)
        with ws_connect(server.url) as ws:  # the squatters were reaped
            assert ask(ws, {"type": "reset"})["type"] == "observation"
            assert server.active_sessions == 1


def test_a_connection_that_sends_only_garbage_holds_no_slot_and_is_closed() -> None:
    settings = ServerSettings(first_message_timeout_s=0.5)
    with (
        OpenEnvServer(make_env=EchoEnv, max_concurrent_envs=1, settings=settings) as server,
        ws_connect(server.url) as squatter,
    ):
        squatter.send("garbage")
        assert json.loads(squatter.recv(timeout=5))["data"]["code"] == "INVALID_JSON"
        assert server.active_sessions == 0
        with ws_connect(server.url) as ws:  # the one slot is free
            assert ask(ws, {"type": "reset"})["type"] == "observation"
            assert ask(ws, {"type": "step", "data": {"message": "hi"}})["data"]["reward"] == 1
        with pytest.raises(ConnectionClosed) as closed:
            squatter.recv(timeout=5)
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == 1008


def make_napping_tools_environment() -> Any:
    """An OpenEnv MCP env whose sync tool ``nap`` blocks until the test releases it (or
    ``seconds`` pass)."""
    from fastmcp import FastMCP
    from openenv.core.env_server.mcp_environment import MCPEnvironment
    from openenv.core.env_server.types import Observation, State

    class NappingEnvironment(MCPEnvironment):  # type: ignore[misc]
        def __init__(self) -> None:
            server = FastMCP("napping")

            @server.tool
            def nap(seconds: float) -> str:
                """Block until released, or for ``seconds``."""
                SLOW_CALL_STARTED.set()
                RELEASE.wait(seconds)
                return "rested"

            super().__init__(server)
            self.mcp_client = None  # the server calls its tools' functions itself

        def reset(self, seed: Any = None, episode_id: Any = None, **kwargs: Any) -> Any:
            return Observation(metadata={"ready": True})

        def _step_impl(self, action: Any, timeout_s: Any = None, **kwargs: Any) -> Any:
            return Observation()

        @property
        def state(self) -> Any:
            return State(episode_id=None, step_count=0)

    return NappingEnvironment()


def test_a_slow_sync_mcp_tool_leaves_the_event_loop_free() -> None:
    from agile_llmenvs.transport._openenv import CallToolAction

    with OpenEnvServer(
        make_env=make_napping_tools_environment, action_cls=CallToolAction
    ) as server:
        call = {
            "jsonrpc": "2.0",
            "method": "tools/call",
            "params": {"name": "nap", "arguments": {"seconds": 30.0}},
            "id": 1,
        }
        listed = httpx.post(server.url + "/mcp", json={**call, "method": "tools/list"}, timeout=30)
        assert listed.json()["result"]["tools"][0]["name"] == "nap"  # imports done, types known
        answers: list[httpx.Response] = []
        waiter = threading.Thread(
            target=lambda: answers.append(httpx.post(server.url + "/mcp", json=call, timeout=40))
        )
        waiter.start()
        assert SLOW_CALL_STARTED.wait(10)
        # the tool runs until the test releases it, so only a free loop answers this
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert not answers
        RELEASE.set()
        waiter.join(10)
        assert "rested" in json.dumps(answers[0].json()["result"])
