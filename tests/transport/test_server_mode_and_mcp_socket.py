"""OpenEnvServer's share of OpenEnv 0.10's server features, as create_asgi_app has them
(``test_openenv_route_suites.py``): the server mode, the ``/mcp`` WebSocket, a session id of
its own for each ``/ws`` session, and the idle timeout on ``/mcp`` connections."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from echo_envs import EchoEnv
from openenv_native import EchoEnvironment, make_tools_environment
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from agile_llmenvs.transport import OpenEnvServer, ServerSettings
from agile_llmenvs.transport._openenv import CallToolAction, CallToolObservation

httpx = pytest.importorskip("httpx")


def rpc(method: str, rid: int, **params: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": method, "params": params, "id": rid}


def ask(ws: ClientConnection, message: dict[str, Any]) -> Any:
    ws.send(json.dumps(message))
    return json.loads(ws.recv(timeout=10))


def ws_url(server: OpenEnvServer, path: str) -> str:
    return server.url.replace("http://", "ws://") + path


def tools_server(**kwargs: Any) -> OpenEnvServer:
    return OpenEnvServer(
        make_env=make_tools_environment,
        action_cls=CallToolAction,
        observation_cls=CallToolObservation,
        **kwargs,
    )


def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


# -- mode ------------------------------------------------------------------------------------


def test_production_mode_drops_the_simulation_controls_and_keeps_ws_sessions() -> None:
    with OpenEnvServer(make_env=EchoEnvironment, mode="production") as server:
        for method, path in [("POST", "/reset"), ("POST", "/step"), ("GET", "/state")]:
            answer = httpx.request(method, server.url + path, json={"action": {"message": "x"}})
            assert (answer.status_code, answer.json()) == (404, {"detail": "Not Found"}), path
        # the other method of a dropped path is unknown too (simulation: 405)
        assert httpx.get(server.url + "/reset").status_code == 404
        assert httpx.post(server.url + "/state", json={}).status_code == 404
        assert httpx.get(server.url + "/health").json() == {"status": "healthy"}
        assert set(httpx.get(server.url + "/schema").json()) >= {"action", "observation"}
        assert httpx.get(server.url + "/metadata").status_code == 200
        listed = httpx.post(server.url + "/mcp", json=rpc("tools/list", 1))
        assert listed.status_code == 200
        with connect(ws_url(server, "/ws")) as ws:  # sessions are unchanged
            assert ask(ws, {"type": "reset", "data": {}})["type"] == "observation"
            stepped = ask(ws, {"type": "step", "data": {"message": "abc"}})
            assert (stepped["data"]["observation"]["echoed"], stepped["data"]["reward"]) == (
                "abc",
                3.0,
            )
            assert ask(ws, {"type": "state"})["type"] == "state"


def test_simulation_is_the_default_and_openenv_mode_is_read_when_no_mode_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with OpenEnvServer(make_env=EchoEnvironment) as server:
        assert httpx.post(server.url + "/reset", json={}).status_code == 200
        assert httpx.get(server.url + "/reset").status_code == 405
    monkeypatch.setenv("OPENENV_MODE", "PRODUCTION")
    with OpenEnvServer(make_env=EchoEnvironment) as server:
        assert httpx.post(server.url + "/reset", json={}).status_code == 404
    with OpenEnvServer(make_env=EchoEnvironment, mode="simulation") as server:
        assert httpx.post(server.url + "/reset", json={}).status_code == 200


def test_an_unknown_mode_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"'simulation'.*'production'"):
        OpenEnvServer(make_env=EchoEnvironment, mode="staging")


# -- the /mcp WebSocket ----------------------------------------------------------------------


def test_the_mcp_websocket_lists_and_calls_tools_on_a_session_of_its_own() -> None:
    with tools_server(max_concurrent_envs=1) as server, connect(ws_url(server, "/mcp")) as ws:
        listed = ask(ws, rpc("tools/list", 1))
        assert [tool["name"] for tool in listed["result"]["tools"]] == ["add", "shout"]
        added = ask(ws, rpc("tools/call", 2, name="add", arguments={"a": 2, "b": 3}))
        assert (added["id"], added["result"]["data"]) == (2, 5)
        shouted = ask(ws, rpc("tools/call", 3, name="shout", arguments={"text": "hi"}))
        assert shouted["result"]["data"] == "HI"
        own = ask(ws, rpc("openenv/session/create", 4))["result"]["session_id"]
        assert ask(ws, rpc("openenv/session/create", 5))["result"]["session_id"] == own
        closing = ask(ws, rpc("openenv/session/close", 6, session_id=own))
        assert closing["error"]["code"] == -32600  # not its own session
        ws.send("{not json")
        assert json.loads(ws.recv(timeout=10))["error"]["code"] == -32700
        assert httpx.get(server.url + "/sessions").json()["active_sessions"] == 1
        with connect(ws_url(server, "/mcp")) as full:  # its slot is taken
            refused = json.loads(full.recv(timeout=10))
            assert refused["error"]["message"] == "Server at capacity (1/1 sessions)"
            assert refused["error"]["data"] == {"active_sessions": 1, "max_sessions": 1}
        ws.close()
        wait_for(lambda: server.active_sessions == 0)
        assert server.active_sessions == 0  # the connection's session ended with it


def test_the_mcp_websocket_takes_the_token_and_a_plain_get_mcp_stays_405() -> None:
    with tools_server(token="s3cret") as server:
        with pytest.raises(InvalidStatus) as refused:
            connect(ws_url(server, "/mcp"))
        assert refused.value.response.status_code == 403
        with connect(ws_url(server, "/mcp?token=s3cret")) as ws:
            added = ask(ws, rpc("tools/call", 1, name="add", arguments={"a": 1, "b": 1}))
            assert added["result"]["data"] == 2
        plain = httpx.get(server.url + "/mcp", headers={"Authorization": "Bearer s3cret"})
        assert (plain.status_code, plain.json()) == (405, {"detail": "Method Not Allowed"})


def test_an_idle_mcp_websocket_is_closed_and_frees_its_slot() -> None:
    settings = ServerSettings(session_idle_timeout_s=0.3)
    with tools_server(settings=settings, max_concurrent_envs=1) as server:
        with connect(ws_url(server, "/mcp")) as ws:
            for rid in (1, 2):  # each message restarts the clock
                time.sleep(0.2)
                assert ask(ws, rpc("tools/list", rid))["id"] == rid
            opened = time.monotonic()
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
            idle_s = time.monotonic() - opened
        assert closed.value.rcvd is not None
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1001, "session idle timeout")
        assert 0.2 < idle_s < 5.0
        wait_for(lambda: server.active_sessions == 0)
        assert server.active_sessions == 0
        with connect(ws_url(server, "/mcp")) as again:  # the slot is free for another
            assert ask(again, rpc("tools/list", 3))["id"] == 3


# -- /ws session ids -------------------------------------------------------------------------


def session_id_of(ws: ClientConnection, rid: int) -> str:
    reply = ask(ws, {"type": "mcp", "data": rpc("openenv/session/create", rid)})
    session_id: str = reply["data"]["result"]["session_id"]
    return session_id


def test_each_ws_session_on_one_shared_env_has_an_id_of_its_own() -> None:
    with OpenEnvServer(EchoEnv()) as server:  # one env, one session at a time
        ids = []
        for _ in range(2):
            with connect(ws_url(server, "/ws")) as ws:
                first = session_id_of(ws, 1)
                assert session_id_of(ws, 2) == first  # stable within the session
                ids.append(first)
            wait_for(lambda: server.active_sessions == 0)
        assert ids[0] != ids[1]


def test_concurrent_ws_sessions_have_distinct_ids_and_cannot_close_their_own() -> None:
    with (
        OpenEnvServer(make_env=EchoEnvironment, max_concurrent_envs=2) as server,
        connect(ws_url(server, "/ws")) as one,
        connect(ws_url(server, "/ws")) as two,
    ):
        first, second = session_id_of(one, 1), session_id_of(two, 1)
        assert first != second
        close = {"type": "mcp", "data": rpc("openenv/session/close", 2, session_id=first)}
        assert ask(one, close)["data"]["error"]["code"] == -32600


def test_an_mcp_websocket_message_over_the_size_limit_is_refused_and_the_session_goes_on() -> None:
    settings = ServerSettings(max_message_bytes=1000)
    with tools_server(settings=settings) as server, connect(ws_url(server, "/mcp")) as ws:
        big = json.dumps(rpc("tools/call", 1, name="shout", arguments={"text": "x" * 2000}))
        refused = ask(ws, json.loads(big))
        assert refused == {
            "jsonrpc": "2.0",
            "id": None,  # the request is never parsed, so its id is unknown
            "error": {
                "code": -32600,
                "message": f"Message of {len(big)} bytes exceeds the server's limit of 1000",
                "data": None,
            },
        }
        shouted = ask(ws, rpc("tools/call", 2, name="shout", arguments={"text": "ok"}))
        assert (shouted["id"], shouted["result"]["data"]) == (2, "OK")
