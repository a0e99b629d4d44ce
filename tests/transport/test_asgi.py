"""The ASGI app (create_asgi_app): OpenEnvServer's routes and replies, under starlette's
TestClient and a real ``uvicorn module:app``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from echo_envs import EchoEnv
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from agile_llmenvs.transport import OpenEnvServer, RemoteEnvClient, ServerSettings, create_asgi_app
from agile_llmenvs.transport.asgi import AsgiApp

testclient = pytest.importorskip("starlette.testclient")
WebSocketDisconnect = pytest.importorskip("starlette.websockets").WebSocketDisconnect

TESTS = Path(__file__).resolve().parents[1]

#: One /ws session: good frames, then frames each error path answers.
SCRIPT: list[str | bytes] = [
    json.dumps({"type": "reset", "data": {"seed": 1, "unknown_kwarg": 2}}),
    json.dumps({"type": "step", "data": {"message": "hi"}}),
    json.dumps({"type": "state"}),
    "{not json",
    json.dumps({"type": "teleport"}),
    json.dumps({"type": "step", "data": {"text": "x"}}),
    b"\x00\x01",
    json.dumps({"type": "step", "data": {"message": "boom"}}),
    json.dumps({"type": "step", "data": {"message": "stop"}}),
    json.dumps({"type": "state"}),
]
CLOSE = json.dumps({"type": "close"})


def http_record(
    ask: Callable[[str, str, bytes | None, dict[str, str]], tuple[int, Any]],
) -> list[Any]:
    """Statuses and bodies of the HTTP routes, asked through ``ask``."""
    json_head = {"Content-Type": "application/json"}
    return [
        ask("GET", "/health", None, {}),
        ask("GET", "/metadata", None, {}),
        ask("GET", "/schema", None, {}),
        ask("GET", "/state", None, {}),
        ask("GET", "/sessions", None, {}),
        ask("POST", "/reset", json.dumps({"seed": 3}).encode(), json_head),
        ask("POST", "/reset", b"", {}),
        ask("POST", "/step", json.dumps({"action": {"message": "hi"}}).encode(), json_head),
        ask("POST", "/step", json.dumps({"action": {"nope": 1}}).encode(), json_head),
        ask("POST", "/step", b"{broken", json_head),
        ask("POST", "/health", b"{}", json_head),
        ask("GET", "/reset", None, {}),
        ask("GET", "/nowhere", None, {}),
        ask("POST", "/nowhere", b"{}", json_head),
    ]


def _body(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode()


def urllib_ask(base: str) -> Callable[[str, str, bytes | None, dict[str, str]], tuple[int, Any]]:
    def ask(method: str, path: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, Any]:
        request = urllib.request.Request(base + path, body, headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, _body(reply.read())
        except urllib.error.HTTPError as error:
            return error.code, _body(error.read())

    return ask


def client_ask(client: Any) -> Callable[[str, str, bytes | None, dict[str, str]], tuple[int, Any]]:
    def ask(method: str, path: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, Any]:
        reply = client.request(method, path, content=body, headers=headers)
        return reply.status_code, _body(reply.content)

    return ask


@pytest.fixture
def app_client() -> Iterator[Any]:
    app = create_asgi_app(make_env=EchoEnv, max_concurrent_envs=4)
    with testclient.TestClient(app) as client:
        yield client


def test_http_routes_answer_as_the_websockets_server_does(app_client: Any) -> None:
    with OpenEnvServer(make_env=EchoEnv, max_concurrent_envs=4) as server:
        expected = http_record(urllib_ask(server.url))
    got = http_record(client_ask(app_client))
    assert got == expected
    assert got[0] == (200, {"status": "healthy"})
    assert got[5][0] == 200
    assert got[5][1]["observation"]["prompt"] == "start seed=3"
    assert got[7][0] == 200
    assert got[7][1]["reward"] == 1.0


def test_a_ws_session_gets_the_websockets_servers_frames(app_client: Any) -> None:
    with (
        OpenEnvServer(make_env=EchoEnv, max_concurrent_envs=4) as server,
        connect(server.url.replace("http", "ws") + "/ws", compression=None) as ws,
    ):
        expected = []
        for frame in SCRIPT:
            ws.send(frame)
            expected.append(json.loads(ws.recv(timeout=5)))
        ws.send(CLOSE)
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
        assert closed.value.rcvd is not None
        expected_code = closed.value.rcvd.code
    got = []
    with app_client.websocket_connect("/ws") as ws:
        for frame in SCRIPT:
            if isinstance(frame, bytes):
                ws.send_bytes(frame)
            else:
                ws.send_text(frame)
            got.append(json.loads(ws.receive_text()))
        ws.send_text(CLOSE)
        with pytest.raises(WebSocketDisconnect) as disconnect:
            ws.receive_text()
    assert got == expected
    assert disconnect.value.code == expected_code == 1000
    assert got[0]["data"]["observation"]["prompt"] == "start seed=1"
    assert got[2]["data"]["step_count"] == 1
    assert [g["type"] for g in got[3:8]] == ["error"] * 5
    assert got[8]["data"]["done"] is True
    app = app_client.app
    assert isinstance(app, AsgiApp)
    deadline = time.monotonic() + 5
    while app.active_sessions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert app.active_sessions == 0


def test_a_token_guards_every_route_but_health() -> None:
    app = create_asgi_app(make_env=EchoEnv, token="s3cret")
    with testclient.TestClient(app) as client:
        assert client.get("/health").status_code == 200
        for path in ("/metadata", "/schema", "/openapi.json", "/docs"):
            assert client.get(path).status_code == 403
            assert client.get(path, params={"token": "s3cret"}).status_code == 200
        assert client.post("/reset", json={}).status_code == 403
        good = {"Authorization": "Bearer s3cret"}
        assert client.post("/reset", json={}, headers=good).status_code == 200
        with pytest.raises(WebSocketDisconnect), client.websocket_connect("/ws") as ws:
            ws.receive_text()
        with client.websocket_connect("/ws", headers=good) as ws:
            ws.send_text(json.dumps({"type": "reset", "data": {}}))
            assert json.loads(ws.receive_text())["type"] == "observation"
        assert "?token=s3cret" in client.get("/docs", params={"token": "s3cret"}).text


def test_openapi_lists_the_routes_and_the_envs_schemas(app_client: Any) -> None:
    reply = app_client.get("/openapi.json")
    assert reply.status_code == 200
    doc = reply.json()
    assert doc["openapi"].startswith("3.")
    assert doc["info"]["title"] == "OpenEnv Environment HTTP API"
    assert {"post"} == set(doc["paths"]["/reset"]) == set(doc["paths"]["/step"])
    for path in ("/health", "/metadata", "/schema", "/state"):
        assert "get" in doc["paths"][path]
    schemas = doc["components"]["schemas"]
    for name in ("TextAction", "TextObservation", "TextState", "ResetRequest", "StepResponse"):
        assert name in schemas
    assert "message" in schemas["TextAction"]["properties"]
    text = json.dumps(doc)
    for ref in _refs(doc):  # every $ref resolves within the document
        assert ref.removeprefix("#/components/schemas/") in schemas, (ref, text[:200])
    docs = app_client.get("/docs")
    assert docs.status_code == 200
    assert "text/html" in docs.headers["content-type"]
    assert "swagger-ui" in docs.text
    assert '"/openapi.json"' in docs.text
    redoc = app_client.get("/redoc")
    assert redoc.status_code == 200
    assert 'spec-url="/openapi.json"' in redoc.text


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_a_shared_env_serves_one_session_and_no_http_episodes() -> None:
    app = create_asgi_app(EchoEnv())
    with testclient.TestClient(app) as client:
        assert client.post("/reset", json={}).status_code == 409
        with client.websocket_connect("/ws") as ws:
            ws.send_text(json.dumps({"type": "reset", "data": {}}))
            assert json.loads(ws.receive_text())["type"] == "observation"
            with client.websocket_connect("/ws") as second:
                reply = json.loads(second.receive_text())
                assert reply["data"]["code"] == "CAPACITY_REACHED"


def test_bad_arguments_are_refused_as_openenvserver_refuses_them() -> None:
    with pytest.raises(ValueError, match="create_asgi_app needs exactly one"):
        create_asgi_app()
    with pytest.raises(ValueError, match="needs `make_env`"):
        create_asgi_app(EchoEnv(), max_concurrent_envs=2)
    with pytest.raises(ValueError, match="token is empty"):
        create_asgi_app(make_env=EchoEnv, token="")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.timeout(120)
def test_uvicorn_module_app_serves_a_remote_env_client(tmp_path: Path) -> None:
    pytest.importorskip("uvicorn")
    (tmp_path / "echo_app.py").write_text(
        textwrap.dedent(
            """
            from echo_envs import EchoEnv

            from agile_llmenvs.transport import create_asgi_app

            app = create_asgi_app(make_env=EchoEnv, max_concurrent_envs=2)
            """
        )
    )
    port = _free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(tmp_path), str(TESTS), env.get("PYTHONPATH", "")) if p
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "echo_app:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            # the documented command: the request deadline (here 1 s) and connection cap
            "--http",
            "agile_llmenvs.transport.uvicorn_limits:GuardedH11Protocol",
            "--limit-concurrency",
            "64",
            "--timeout-keep-alive",
            "5",
        ],
        env={**env, "AGILE_LLMENVS_REQUEST_TIMEOUT_S": "1"},
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                    assert json.loads(reply.read()) == {"status": "healthy"}
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    output = proc.stdout.read().decode() if proc.stdout else ""
                    pytest.fail(f"uvicorn did not come up: {output}")
                time.sleep(0.1)
        with RemoteEnvClient(url) as remote:
            first = remote.reset(seed=7)
            assert first.observation["prompt"] == "start seed=7"
            reply = remote.step("hi")
            assert (reply.observation["prompt"], reply.reward) == ("1:hi", 1.0)
            assert remote.state()["step_count"] == 1
            assert remote.step("stop").done
        status, schema = urllib_ask(url)("GET", "/openapi.json", None, {})
        assert status == 200
        assert "/step" in schema["paths"]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as silent:
            silent.sendall(b"GET /health HTTP/1.1\r\n")  # and never the rest
            start = time.monotonic()
            assert silent.recv(1) == b""  # closed by the server at the deadline
            assert 0.8 < time.monotonic() - start < 3.0
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_idle_and_silent_connections_are_closed_by_the_session_code() -> None:
    settings = ServerSettings(session_idle_timeout_s=0.3, first_message_timeout_s=0.3)
    app = create_asgi_app(make_env=EchoEnv, settings=settings)
    with testclient.TestClient(app) as client:
        # a connection that sends nothing: 1008
        with client.websocket_connect("/ws") as ws, pytest.raises(WebSocketDisconnect) as silent:
            ws.receive_text()
        assert silent.value.code == 1008
        with client.websocket_connect("/ws") as ws:  # a session, then idle: 1001
            ws.send_text(json.dumps({"type": "reset", "data": {}}))
            assert json.loads(ws.receive_text())["type"] == "observation"
            with pytest.raises(WebSocketDisconnect) as idle:
                ws.receive_text()
        assert idle.value.code == 1001
        assert isinstance(client.app, AsgiApp)
        deadline = time.monotonic() + 5
        while client.app.active_sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.app.active_sessions == 0


def test_an_idle_mcp_websocket_is_closed_and_frees_its_slot() -> None:
    settings = ServerSettings(session_idle_timeout_s=0.3)
    app = create_asgi_app(make_env=EchoEnv, settings=settings, max_concurrent_envs=1)
    with testclient.TestClient(app) as client:
        with client.websocket_connect("/mcp") as ws:
            create = {"jsonrpc": "2.0", "method": "openenv/session/create", "id": 1}
            ws.send_text(json.dumps(create))
            assert "session_id" in json.loads(ws.receive_text())["result"]
            assert app.active_sessions == 1
            with pytest.raises(WebSocketDisconnect) as idle:
                ws.receive_text()
        assert idle.value.code == 1001
        deadline = time.monotonic() + 5
        while app.active_sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        assert app.active_sessions == 0


def test_http_bodies_over_the_message_limit_are_refused() -> None:
    app = create_asgi_app(make_env=EchoEnv, settings=ServerSettings(max_message_bytes=1000))
    with testclient.TestClient(app) as client:
        reply = client.post("/step", content=b"x" * 2000)
        assert reply.status_code == 413
        assert reply.json() == {"detail": "Body of 2000 bytes exceeds 1000"}
        streamed = client.post("/step", content=iter([b"x" * 600, b"x" * 600]))
        assert streamed.status_code == 413


@pytest.mark.parametrize("mode", ["simulation", "production"])
def test_register_routes_adds_ours_beside_the_apps_own(mode: str) -> None:
    """As OpenEnv's ``register_routes(app, mode=...)``: the routes join the user's FastAPI
    app (``app.routes`` lists them), whose own routes and docs stay its own; production mode
    adds no simulation controls."""
    fastapi = pytest.importorskip("fastapi")
    from agile_llmenvs.transport import register_routes

    app = fastapi.FastAPI()

    @app.get("/hello")
    def hello() -> dict[str, str]:
        return {"hello": "world"}

    served = register_routes(app, make_env=EchoEnv, token="s3cret", mode=mode)
    paths = {getattr(route, "path", None) for route in app.routes}
    assert {"/hello", "/health", "/schema", "/metadata", "/ws", "/mcp", "/docs"} <= paths
    assert ({"/reset", "/step", "/state"} <= paths) == (mode == "simulation")
    good = {"Authorization": "Bearer s3cret"}
    with testclient.TestClient(app) as client:
        assert client.get("/hello").json() == {"hello": "world"}
        assert client.get("/health").json() == {"status": "healthy"}
        assert client.get("/schema").status_code == 403  # our token guards our routes
        assert client.get("/schema", headers=good).status_code == 200
        assert "/hello" in client.get("/openapi.json").json()["paths"]  # FastAPI's own docs
        with client.websocket_connect("/ws", headers=good) as ws:
            ws.send_text(json.dumps({"type": "reset", "data": {"seed": 3}}))
            assert json.loads(ws.receive_text())["data"]["observation"]["prompt"] == (
                "start seed=3"
            )
        if mode == "simulation":
            reset = client.post("/reset", json={"seed": 7}, headers=good)
            assert reset.json()["observation"]["prompt"] == "start seed=7"
        else:
            assert client.post("/reset", json={}, headers=good).status_code in (404, 405)
    assert served.active_sessions == 0  # the app's shutdown closed ours
