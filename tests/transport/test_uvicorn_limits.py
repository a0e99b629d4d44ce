"""The ASGI app under uvicorn with ``agile-llmenvs serve``'s limits on slow clients
(:mod:`agile_llmenvs.transport.uvicorn_limits`): a client that sends its request headers or
body a byte at a time, or connects and sends nothing, is dropped at the request deadline,
while a request that is in may take as long as its env call, WebSocket sessions play, and a
legitimate client is served throughout. Plain uvicorn, the control, keeps the slow clients."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from echo_envs import EchoEnv
from serving import UvicornApp

pytest.importorskip("uvicorn")

from agile_llmenvs.transport import RemoteEnvClient, create_asgi_app
from agile_llmenvs.transport.uvicorn_limits import (
    GuardedH11Protocol,
    guarded_uvicorn_settings,
)

DEADLINE_S = 1.0


@pytest.fixture
def serve() -> Iterator[Any]:
    started: list[UvicornApp] = []

    def start(settings: dict[str, Any]) -> UvicornApp:
        app = create_asgi_app(make_env=EchoEnv, max_concurrent_envs=4)
        started.append(UvicornApp(app, **settings))
        return started[-1]

    yield start
    for served in started:
        served.close()


def _slow_clients(port: int) -> list[socket.socket]:
    """Connections that each hold the server a slow way: a request line, a body begun, or
    nothing yet; :func:`_trickle` then sends a byte on each every 0.1 s (so uvicorn's
    keep-alive timer, reset by any data, never fires)."""
    clients = []
    for kind in ("headers", "body", "silent") * 4:
        client = socket.create_connection(("127.0.0.1", port))
        if kind == "body":
            client.sendall(
                b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n{"
            )
        elif kind == "headers":
            client.sendall(b"GET /health HTTP/1.1\r\n")
        clients.append(client)
    return clients


def _trickle(clients: list[socket.socket], seconds: float) -> None:
    """Send a byte on every slow connection every 0.1 s for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for client in clients:
            with contextlib.suppress(OSError):  # closed by the server
                client.sendall(b"X")
        time.sleep(0.1)


def _open(clients: list[socket.socket]) -> int:
    """How many of ``clients`` the server has not closed."""
    still = 0
    for client in clients:
        client.setblocking(False)
        try:
            still += client.recv(1) != b""
        except BlockingIOError:
            still += 1  # nothing to read: open
        except OSError:
            pass  # reset: closed
    return still


def _healthy(url: str) -> bool:
    with urllib.request.urlopen(url + "/health", timeout=5) as reply:
        return json.loads(reply.read()) == {"status": "healthy"}


def test_slow_and_silent_clients_are_dropped_at_the_request_deadline(serve: Any) -> None:
    served = serve(guarded_uvicorn_settings(request_timeout_s=DEADLINE_S))
    clients = _slow_clients(served.port)
    try:
        _trickle(clients, DEADLINE_S / 2)
        assert _open(clients) == len(clients)  # within the deadline: still open
        assert _healthy(served.url)  # a legitimate client is served meanwhile
        _trickle(clients, DEADLINE_S + 1.0)
        assert _open(clients) == 0
        assert _healthy(served.url)
    finally:
        for client in clients:
            client.close()


def test_plain_uvicorn_keeps_them_the_control(serve: Any) -> None:
    served = serve({"timeout_keep_alive": 5})
    clients = _slow_clients(served.port)
    try:
        _trickle(clients, DEADLINE_S + 1.5)
        assert _open(clients) == len(clients)  # every one still held
    finally:
        for client in clients:
            client.close()


def test_a_request_that_is_in_may_take_as_long_as_its_env_call(serve: Any) -> None:
    """The deadline covers the client's sending only: an env step of 2 s (twice the
    deadline) answers over HTTP and over a WebSocket session, and a kept-alive connection
    serves a second request after it."""
    served = serve(guarded_uvicorn_settings(request_timeout_s=DEADLINE_S))
    with RemoteEnvClient(served.url) as remote:  # a /ws session
        remote.reset(seed=1)
        start = time.monotonic()
        assert remote.step(f"sleep:{2 * DEADLINE_S}").observation["prompt"].startswith("1:")
        assert time.monotonic() - start >= 2 * DEADLINE_S
        time.sleep(DEADLINE_S + 0.5)  # an open session is no request: it is not cut
        assert remote.step("again").observation["prompt"] == "2:again"
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    try:
        for _ in range(2):  # one kept-alive connection: the deadline re-armed for the second
            body = json.dumps({"action": {"message": f"sleep:{2 * DEADLINE_S}"}})
            connection.request("POST", "/step", body, {"Content-Type": "application/json"})
            reply = connection.getresponse()
            assert reply.status == 200
            assert json.loads(reply.read())["observation"]["prompt"].endswith("sleep:2.0")
    finally:
        connection.close()


def test_the_settings_refuse_what_cannot_work() -> None:
    assert GuardedH11Protocol.request_timeout_s == 10.0
    settings = guarded_uvicorn_settings()
    assert settings["limit_concurrency"] == 1024
    assert settings["timeout_keep_alive"] == 5
    assert settings["http"].request_timeout_s == 10.0
    with pytest.raises(ValueError, match="request_timeout_s must be above 0, got 0"):
        guarded_uvicorn_settings(request_timeout_s=0)
    with pytest.raises(ValueError, match="limit_concurrency must be at least 1, got 0"):
        guarded_uvicorn_settings(limit_concurrency=0)


def test_a_token_in_a_url_stays_out_of_the_access_log() -> None:
    """``/docs?token=...`` is how a person opens the docs page (which passes the token on to
    ``/openapi.json``); uvicorn's access log writes each request's URL. The guarded protocol
    writes ``token=***`` there."""
    import logging

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    app = create_asgi_app(make_env=EchoEnv, token="s3cret-value")
    access, lines = logging.getLogger("uvicorn.access"), Lines()
    with UvicornApp(app, **guarded_uvicorn_settings()) as served:
        level = access.level
        access.setLevel(logging.INFO)  # the fixture's uvicorn logs warnings only
        access.addHandler(lines)
        try:
            for path in ("/docs?token=s3cret-value", "/openapi.json?x=1&token=s3cret-value"):
                with urllib.request.urlopen(served.url + path, timeout=5) as reply:
                    assert reply.status == 200
        finally:
            access.removeHandler(lines)
            access.setLevel(level)
    assert len(lines.lines) == 2
    assert not any("s3cret-value" in line for line in lines.lines)
    assert '"GET /docs?token=*** HTTP/1.1" 200' in lines.lines[0]
    assert '"GET /openapi.json?x=1&token=*** HTTP/1.1" 200' in lines.lines[1]
