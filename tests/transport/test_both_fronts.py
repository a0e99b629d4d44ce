"""The same attacks on both ways of serving an env over real sockets: ``OpenEnvServer``
(``agile-llmenvs serve``) and the ASGI app under uvicorn with
:mod:`~agile_llmenvs.transport.uvicorn_limits`. A missing token, a body over the message
limit, non-finite numbers and a session past capacity get the same answer from both."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from echo_envs import EchoEnv
from serving import UvicornApp
from websockets.exceptions import ConnectionClosedError, InvalidStatus
from websockets.sync.client import connect

pytest.importorskip("uvicorn")

from agile_llmenvs.transport import OpenEnvServer, ServerSettings, create_asgi_app
from agile_llmenvs.transport.uvicorn_limits import guarded_uvicorn_settings

TOKEN = "s3cret"
GOOD = {"Authorization": f"Bearer {TOKEN}"}
SETTINGS = ServerSettings(max_message_bytes=1000)


@pytest.fixture(params=["serve", "uvicorn"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A server of EchoEnv with a token, a 1,000-byte message limit and one env at a time."""
    if request.param == "serve":
        with OpenEnvServer(
            make_env=EchoEnv, token=TOKEN, settings=SETTINGS, max_concurrent_envs=1
        ) as server:
            yield server.url
        return
    app = create_asgi_app(make_env=EchoEnv, token=TOKEN, settings=SETTINGS, max_concurrent_envs=1)
    with UvicornApp(app, **guarded_uvicorn_settings()) as served:
        yield served.url


def _reset(ws: Any) -> Any:
    ws.send(json.dumps({"type": "reset", "data": {}}))
    return json.loads(ws.recv(timeout=10))


def _reset_past_capacity(ws: Any) -> None:
    """Reset on a connection the server refuses for capacity (an error frame, then close
    1013, right after the handshake): the refusal usually lands before the reset goes out,
    which then raises; on a loaded machine the reset may go out first, and its recv reads
    the error frame before the close. Raises ``ConnectionClosedError`` either way."""
    refused = _reset(ws)
    assert refused["data"]["code"] == "CAPACITY_REACHED", refused
    ws.recv(timeout=10)


def _ws(url: str) -> str:
    return url.replace("http://", "ws://")


def test_a_token_guards_every_route_but_health(url: str) -> None:
    assert httpx.get(url + "/health").status_code == 200
    routes: list[tuple[str, str, Any]] = [
        ("GET", "/metadata", None),
        ("GET", "/schema", None),
        ("GET", "/state", None),
        ("GET", "/openapi.json", None),
        ("GET", "/docs", None),
        ("POST", "/reset", {}),
        ("POST", "/step", {"action": {"message": "x"}}),
        ("POST", "/mcp", {"jsonrpc": "2.0", "method": "tools/list", "id": 1}),
    ]
    for method, path, body in routes:
        assert httpx.request(method, url + path, json=body).status_code == 403, path
        wrong = httpx.request(method, url + path, json=body, headers={"Authorization": "Bearer x"})
        assert wrong.status_code == 403, path
    for path in ("/ws", "/mcp"):
        with pytest.raises(InvalidStatus) as refused, connect(_ws(url) + path):
            pass
        assert refused.value.response.status_code == 403, path
    assert httpx.post(url + "/reset", json={}, headers=GOOD).status_code == 200


def test_a_body_over_the_message_limit_is_refused(url: str) -> None:
    big = httpx.post(url + "/step", json={"action": {"message": "x" * 2000}}, headers=GOOD)
    assert big.status_code == 413
    assert big.json() == {"detail": f"Body of {len(big.request.content)} bytes exceeds 1000"}
    replies = []
    with connect(_ws(url) + "/ws", additional_headers=GOOD) as ws:
        ws.send(json.dumps({"type": "reset", "data": {}}))
        assert json.loads(ws.recv(timeout=10))["type"] == "observation"
        ws.send(json.dumps({"type": "step", "data": {"message": "x" * 2000}}))
        replies.append(json.loads(ws.recv(timeout=10)))
        ws.send(json.dumps({"type": "step", "data": {"message": "small"}}))  # it goes on
        assert json.loads(ws.recv(timeout=10))["type"] == "observation"
    [reply] = replies
    assert reply["type"] == "error"
    assert "1000" in json.dumps(reply), reply


def test_non_finite_numbers_are_refused(url: str) -> None:
    body = b'{"seed": NaN}'
    reply = httpx.post(
        url + "/reset", content=body, headers={**GOOD, "Content-Type": "application/json"}
    )
    assert reply.status_code in (400, 422)
    with connect(_ws(url) + "/ws", additional_headers=GOOD) as ws:
        ws.send('{"type": "reset", "data": {"seed": Infinity}}')
        refused = json.loads(ws.recv(timeout=10))
        assert refused["type"] == "error"
        assert refused["data"]["code"] == "INVALID_JSON"


def test_a_session_past_capacity_is_refused_and_the_first_plays_on(url: str) -> None:
    with connect(_ws(url) + "/ws", additional_headers=GOOD) as first:
        first.send(json.dumps({"type": "reset", "data": {}}))
        assert json.loads(first.recv(timeout=10))["type"] == "observation"
        with connect(_ws(url) + "/ws", additional_headers=GOOD) as second:
            with pytest.raises(ConnectionClosedError) as closed:
                _reset_past_capacity(second)
            assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1013, "at capacity")
        first.send(json.dumps({"type": "step", "data": {"message": "hi"}}))
        assert json.loads(first.recv(timeout=10))["type"] == "observation"


def _read_reply(sock: socket.socket) -> bytes:
    """One HTTP reply, head and ``Content-Length`` body (b"" if the server closed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head


def test_a_kept_alive_client_reads_every_reply(url: str) -> None:
    """A reply on a connection the server then closes says ``Connection: close``; on one it
    keeps, the next request is answered. (``agile-llmenvs serve`` closed after each plain
    GET without saying so, and a keep-alive client such as OpenEnv's ``HarborEnv`` now and
    then sent its next request on the closing connection: "Server disconnected".)"""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        sock.sendall(request)
        head = _read_reply(sock)
        assert head.startswith(b"HTTP/1.1 200")
        if b"\r\nconnection: close" not in head.lower():
            sock.sendall(request)
            assert _read_reply(sock).startswith(b"HTTP/1.1 200")
    with httpx.Client(base_url=url, headers=GOOD) as client:
        for _ in range(20):
            assert client.get("/health").status_code == 200
            assert client.post("/reset", json={}).status_code == 200
