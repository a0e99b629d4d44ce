"""The env server's plain HTTP side: what OpenEnv's ``create_app`` has no twin for (tokens,
limits, shared envs, MCP session lifecycles) and what raw sockets show (100-continue)."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest
from echo_envs import EchoEnv
from openenv_native import EchoEnvironment, make_tools_environment
from websockets.sync.client import connect

from agile_llmenvs.transport import OpenEnvServer, ServerSettings
from agile_llmenvs.transport._openenv import CallToolAction, CallToolObservation

httpx = pytest.importorskip("httpx")
JSON_HEADERS = {"Content-Type": "application/json"}


def rpc(method: str, rid: int = 1, **params: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": method, "params": params, "id": rid}


def raw_http(url: str, request: bytes, *, send_after: bytes = b"") -> bytes:
    """Send ``request`` on a raw socket (and ``send_after`` once a first reply arrives);
    everything the server sends until it closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        if send_after:
            chunks.append(sock.recv(65536))
            sock.sendall(send_after)
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_a_token_guards_every_route_but_health() -> None:
    with OpenEnvServer(make_env=EchoEnvironment, token="s3cret") as server:
        assert httpx.get(server.url + "/health").status_code == 200
        for method, path, body in [
            ("GET", "/metadata", None),
            ("GET", "/schema", None),
            ("GET", "/state", None),
            ("POST", "/reset", {}),
            ("POST", "/step", {"action": {"message": "x"}}),
            ("POST", "/mcp", rpc("tools/list")),
        ]:
            refused = httpx.request(method, server.url + path, json=body)
            assert (refused.status_code, refused.json()) == (
                403,
                {"detail": "missing or wrong token"},
            ), path
        allowed = httpx.post(
            server.url + "/step",
            json={"action": {"message": "abc"}},
            headers={"Authorization": "Bearer s3cret"},
        )
        assert allowed.json() == {
            "observation": {"echoed": "abc", "length": 3, "metadata": {}},
            "reward": 3.0,
            "done": False,
            "metadata": None,  # OpenEnv's StepResponse has it
        }
        by_query = httpx.post(server.url + "/reset?token=s3cret", json={})
        assert by_query.status_code == 200


def test_http_bodies_are_bounded_and_must_say_their_length() -> None:
    settings = ServerSettings(max_message_bytes=1000)
    with OpenEnvServer(make_env=EchoEnvironment, settings=settings) as server:
        big = httpx.post(server.url + "/step", json={"action": {"message": "x" * 2000}})
        assert (big.status_code, big.json()) == (
            413,
            {"detail": f"Body of {len(big.request.content)} bytes exceeds 1000"},
        )
        head = b"POST /reset HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        chunked = raw_http(server.url, head + b"2\r\n{}\r\n0\r\n\r\n")
        assert chunked.startswith(b"HTTP/1.1 411 Length Required\r\n")
        assert chunked.endswith(b'{"detail": "Send the body with a Content-Length"}')
        # the server still serves sessions and requests after all of these
        assert httpx.post(server.url + "/reset", json={}).status_code == 200


def test_a_client_that_expects_100_continue_gets_it_before_sending_the_body() -> None:
    body = json.dumps({"action": {"message": "hi"}}).encode()
    head = (
        b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    with OpenEnvServer(make_env=EchoEnvironment) as server:
        reply = raw_http(server.url, head, send_after=body)
    interim, _, final = reply.partition(b"\r\n\r\n")
    assert interim == b"HTTP/1.1 100 Continue"
    assert final.startswith(b"HTTP/1.1 200 OK\r\n")
    assert final.endswith(b'"reward": 2.0, "done": false, "metadata": null}')


def test_a_shared_env_serves_no_http_episodes() -> None:
    with OpenEnvServer(EchoEnv()) as server:
        for method, path in [("POST", "/reset"), ("POST", "/step"), ("GET", "/state")]:
            refused = httpx.request(method, server.url + path, json={"action": {}})
            assert refused.status_code == 409, path
            assert refused.json()["detail"].startswith("this server shares one env")
        assert httpx.get(server.url + "/schema").json()["action"]["title"] == "TextAction"


def test_mcp_sessions_count_against_capacity_and_close_when_their_socket_leaves() -> None:
    with OpenEnvServer(
        make_env=make_tools_environment,
        action_cls=CallToolAction,
        observation_cls=CallToolObservation,
        max_concurrent_envs=1,
    ) as server:
        made = httpx.post(server.url + "/mcp", json=rpc("openenv/session/create")).json()
        session_id = made["result"]["session_id"]
        full = httpx.post(server.url + "/mcp", json=rpc("openenv/session/create", 2)).json()
        assert full["error"]["message"] == "Server at capacity (1/1 sessions)"
        assert full["error"]["data"] == {"active_sessions": 1, "max_sessions": 1}
        ws_url = server.url.replace("http://", "ws://") + f"/ws?session_id={session_id}"
        with connect(ws_url) as ws:
            with connect(ws_url) as second:  # one socket per session
                refused = json.loads(second.recv(timeout=5))
                assert refused == {
                    "type": "error",
                    "data": {
                        "message": f"Session {session_id} already has an attached WebSocket",
                        "code": "SESSION_ERROR",
                    },
                }
            ws.send(
                json.dumps(
                    {
                        "type": "mcp",
                        "data": rpc("tools/call", 3, name="add", arguments={"a": 1, "b": 2}),
                    }
                )
            )
            assert json.loads(ws.recv(timeout=5))["data"]["result"]["data"] == 3
            closing = httpx.post(
                server.url + "/mcp", json=rpc("openenv/session/close", 4, session_id=session_id)
            ).json()
            assert closing["result"] == {"session_id": session_id, "closed": False, "closing": True}
        deadline = time.monotonic() + 5
        while server.active_sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.active_sessions == 0  # the waiting close ran when the socket left
        gone = httpx.post(server.url + "/mcp", json=rpc("tools/list", 5, session_id=session_id))
        assert gone.json()["error"]["message"] == f"Unknown session_id: {session_id}"


def test_an_unused_mcp_session_is_reaped_after_the_idle_timeout() -> None:
    settings = ServerSettings(mcp_session_idle_timeout_s=0.2)
    with OpenEnvServer(
        make_env=make_tools_environment,
        action_cls=CallToolAction,
        max_concurrent_envs=1,
        settings=settings,
    ) as server:
        httpx.post(server.url + "/mcp", json=rpc("openenv/session/create"))
        assert server.active_sessions == 1
        time.sleep(0.3)
        again = httpx.post(server.url + "/mcp", json=rpc("openenv/session/create", 2)).json()
        assert "session_id" in again["result"]  # the idle one was ended to make room
        assert server.active_sessions == 1


@pytest.mark.parametrize("front", ["server", "asgi"])
def test_a_body_with_a_wrong_token_is_refused_at_its_headers(front: str) -> None:
    """The head says 8 MiB are coming and carries a wrong token: the reply comes before a
    byte of the body is sent (it used to be read whole first: 150 such bodies held 1.2 GB)."""
    from serving import UvicornApp

    from agile_llmenvs.transport import create_asgi_app

    head = (
        b"POST /reset HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
        b"Content-Type: application/json\r\nContent-Length: 8388608\r\n\r\n"
    )
    if front == "server":
        served: Any = OpenEnvServer(make_env=EchoEnvironment, token="s3cret")
    else:
        served = UvicornApp(create_asgi_app(make_env=EchoEnvironment, token="s3cret"))
    with served:
        host, port = served.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(head)  # and no body
            reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 403")
        assert b'"missing or wrong token"' in reply
        # the right token's body is still read and answered
        right = httpx.post(
            served.url + "/reset", json={}, headers={"Authorization": "Bearer s3cret"}
        )
        assert right.status_code == 200


@pytest.mark.parametrize("front", ["server", "asgi"])
def test_silent_mcp_sockets_are_closed_at_the_first_message_timeout_holding_nothing(
    front: str,
) -> None:
    """Two /mcp WebSockets that never send a message, on a server of two slots: they used to
    hold both (an env built for each) until the 1,800 s idle timeout, and a new /ws got 1013.
    Now a session is made at the first message: they are closed at first_message_timeout_s,
    as silent /ws connections are, and hold no slot meanwhile."""
    from serving import UvicornApp
    from websockets.exceptions import ConnectionClosed

    from agile_llmenvs.transport import create_asgi_app

    settings = ServerSettings(first_message_timeout_s=0.5)
    made: list[int] = []

    def make_env() -> Any:
        made.append(1)
        return make_tools_environment()

    arguments: dict[str, Any] = {
        "make_env": make_env,
        "action_cls": CallToolAction,
        "observation_cls": CallToolObservation,
        "max_concurrent_envs": 2,
        "settings": settings,
    }
    served: Any = (
        OpenEnvServer(**arguments)
        if front == "server"
        else UvicornApp(create_asgi_app(**arguments))
    )
    with served:
        base = served.url.replace("http://", "ws://")
        silent = [connect(base + "/mcp"), connect(base + "/mcp")]
        time.sleep(0.2)
        assert made == []  # nothing built for a connection that said nothing
        for ws in silent:
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=5)
            assert closed.value.rcvd is not None
            assert closed.value.rcvd.code == 1008
        with connect(base + "/ws") as ws:  # both slots are free
            ws.send(json.dumps({"type": "reset", "data": {}}))
            # (the process's first tools env imports its MCP server: seconds)
            assert json.loads(ws.recv(timeout=60))["type"] == "observation"
        with connect(base + "/mcp") as ws:  # one that speaks gets its session
            ws.send(json.dumps(rpc("tools/list")))
            assert "tools" in json.loads(ws.recv(timeout=60))["result"]


def test_json_nested_deeper_than_the_parser_follows_is_answered_as_invalid_json() -> None:
    """200,000 ``[``: the parser's RecursionError used to escape every handler, closing the
    connection (1011) with no reply. Now it is invalid JSON, answered, and the session goes
    on."""
    deep = "[" * 200_000
    with OpenEnvServer(make_env=EchoEnvironment) as server:
        with connect(server.url.replace("http://", "ws://") + "/ws") as ws:
            ws.send(deep)
            error = json.loads(ws.recv(timeout=10))
            assert error["data"]["code"] == "INVALID_JSON"
            assert error["data"]["message"] == (
                "Invalid JSON: nested deeper than the parser can follow (Python's recursion limit)"
            )
            ws.send(json.dumps({"type": "reset", "data": {}}))
            assert json.loads(ws.recv(timeout=10))["type"] == "observation"
        parse = httpx.post(server.url + "/mcp", content=deep, headers=JSON_HEADERS).json()
        assert parse["error"]["code"] == -32700
