"""Serve envs as an ASGI app: ``uvicorn module:app``, a Hugging Face Space, starlette's TestClient.

:class:`~agile_llmenvs.transport.server.OpenEnvServer` (the ``websockets`` server, our fast
default) is not an ASGI app. :func:`create_asgi_app` serves the same routes with the same
replies to any ASGI server: HTTP requests go to the same
:class:`~agile_llmenvs.transport.routes.HttpRoutes`, and each ``/ws`` connection to the same
:class:`~agile_llmenvs.transport.sessions.SessionHost` session code, through
:class:`AsgiWebSocket` (an ASGI websocket dressed as the ``websockets`` connection the
session code reads). Beside them, as OpenEnv's ``create_app`` does, ``GET /openapi.json``
(OpenAPI 3.1, with the env's action, observation and state JSON schemas), ``/docs`` (Swagger
UI) and ``/redoc``. ``mode="production"`` drops ``POST /reset``, ``/step`` and ``GET /state``,
as OpenEnv's production mode does, and serves OpenEnv's ``/harness`` WebSocket when the env is
an OpenEnv ``HarnessEnvironment`` (:mod:`~agile_llmenvs.transport.harness_route`).

No web framework is needed: the app is a plain ASGI callable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import parse_qs

from websockets.exceptions import ConnectionClosed, ConnectionClosedError, ConnectionClosedOK
from websockets.frames import Close

from agile_llmenvs.transport.harness_route import HARNESS_PATH
from agile_llmenvs.transport.http import SERVER_ERROR, HttpRequest, HttpResponse
from agile_llmenvs.transport.openapi import openapi_document, redoc_html, swagger_html
from agile_llmenvs.transport.routes import ServerMode, server_mode
from agile_llmenvs.transport.served import DEFAULT_MAX_SESSIONS, EnvLike, ServedEnv
from agile_llmenvs.transport.server import build_session_host
from agile_llmenvs.transport.sessions import SessionHost
from agile_llmenvs.transport.settings import ServerSettings

__all__ = ["AsgiApp", "AsgiWebSocket", "create_asgi_app"]

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_DOC_PATHS = frozenset({"/openapi.json", "/docs", "/redoc"})


def create_asgi_app(
    env: EnvLike | ServedEnv | None = None,
    *,
    make_env: Callable[[], EnvLike] | None = None,
    env_name: str | None = None,
    max_concurrent_envs: int | None = DEFAULT_MAX_SESSIONS,
    token: str | None = None,
    settings: ServerSettings | None = None,
    action_cls: type | None = None,
    observation_cls: type | None = None,
    state_cls: type | None = None,
    mode: ServerMode | str | None = None,
) -> AsgiApp:
    """An ASGI app serving ``env`` or ``make_env`` as :class:`OpenEnvServer` does.

    Takes :class:`~agile_llmenvs.transport.server.OpenEnvServer`'s arguments (less the
    socket's: the ASGI server binds; a :class:`~agile_llmenvs.transport.served.ServedEnv` in
    place of ``env`` and the keywords that say what is served) and serves its routes with
    its replies: ``/ws``
    sessions, ``GET /health``, ``/metadata``, ``/schema``, ``/state``, ``/sessions``,
    ``POST /reset``, ``/step``, ``/mcp``; and, as OpenEnv's ``create_app`` does,
    ``GET /openapi.json``, ``/docs`` and ``/redoc``. The ``token`` guards every route but
    ``/health`` (open ``/docs?token=...``: the page passes it on to ``/openapi.json``).

    ``/docs`` and ``/redoc`` are pages whose scripts (Swagger UI, ReDoc) the *browser* that
    opens them loads from a CDN (:data:`~agile_llmenvs.transport.openapi.SWAGGER_JS`,
    :data:`~agile_llmenvs.transport.openapi.REDOC_JS`); the server itself
    makes no network call.

    ``mode`` is OpenEnv's server mode: ``"simulation"`` serves every route above;
    ``"production"`` drops the simulation controls ``POST /reset``, ``/step`` and
    ``GET /state`` (404, as OpenEnv's ``register_routes(app, mode="production")`` does) and
    keeps the rest, ``/ws`` sessions included, and serves the ``/harness`` WebSocket for an
    OpenEnv ``HarnessEnvironment``. None reads ``OPENENV_MODE`` (default
    ``"simulation"``), as ``create_app`` does.

    Run it with ``uvicorn module:app --http
    agile_llmenvs.transport.uvicorn_limits:GuardedH11Protocol --limit-concurrency 1024``
    (``app = create_asgi_app(make_env=MyEnv)`` in ``module``): plain uvicorn lets a client
    take as long as it likes to send a request (:mod:`~agile_llmenvs.transport.uvicorn_limits`
    gives it our server's deadline). uvicorn's own WebSocket ping and size limits apply
    (``--ws-max-size``, ``--ws-ping-interval``), ``settings``' timeouts and message limit as
    on our server.
    The websockets-based :class:`OpenEnvServer` stays the faster way to serve.

    Raises:
        ValueError, TypeError: as :class:`OpenEnvServer` does; ValueError for a ``mode``
            that is neither ``"simulation"`` nor ``"production"``.
    """
    checked_mode = server_mode(mode)
    settings = settings or ServerSettings()
    served = ServedEnv.of(
        env,
        make_env=make_env,
        env_name=env_name,
        max_concurrent_envs=max_concurrent_envs,
        token=token,
        action_cls=action_cls,
        observation_cls=observation_cls,
        state_cls=state_cls,
    )
    host = build_session_host(served, settings, owner="create_asgi_app")
    host.routes.mode = checked_mode
    return AsgiApp(host)


class AsgiApp:
    """The ASGI callable :func:`create_asgi_app` returns, over one :class:`SessionHost`.

    Its lifespan's shutdown closes the MCP sessions made over HTTP and the env threads.
    """

    def __init__(self, host: SessionHost) -> None:
        self.host = host
        self._openapi: dict[str, Any] | None = None

    @property
    def active_sessions(self) -> int:
        """Sessions open right now."""
        return self.host.pool.active_sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "websocket":
            await self._websocket(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    # -- lifespan ----------------------------------------------------------------------------

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def close(self) -> None:
        """Close the MCP sessions made over HTTP and the env threads (the lifespan's end)."""
        with contextlib.suppress(Exception):
            await self.host.pool.close_all()
        self.host.pool.env_calls.close()

    # -- HTTP --------------------------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        path = scope["path"]
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        headers = _headers(scope)
        limit = self.host.settings.max_message_bytes
        body: bytes | None = b""
        refused: HttpResponse | None = _FORBIDDEN  # at the headers: the body is never read
        if path.rstrip("/") == "/health" or self.host.authorized(
            headers.get("authorization", ""), query
        ):
            body, refused = await _read_body(receive, headers, limit)
        if body is None:  # the client left before its request was in
            return
        try:
            if refused is not None:
                answer: HttpResponse | _Page = refused
            elif method == "GET" and path.rstrip("/") in _DOC_PATHS:
                answer = await self._docs(path.rstrip("/"), headers, query)
            elif method == "GET" and not body:
                answer = await self._get(path, headers, query)
            else:
                request = HttpRequest(method, path, query, headers, body)
                answer = await self.host.answer_http(request)
        except Exception:
            logger.exception("%s %s failed", method, path)
            answer = SERVER_ERROR
        if isinstance(answer, _Page):
            content_type, payload, status = "text/html; charset=utf-8", answer.html.encode(), 200
        else:
            content_type, payload, status = answer.content_type, answer.payload(), answer.status
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type.encode()),
                    (b"content-length", str(len(payload)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    async def _get(
        self, path: str, headers: dict[str, str], query: dict[str, list[str]]
    ) -> HttpResponse:
        """A ``GET``, as our server's handshake hook answers it."""
        path = path.rstrip("/")
        if path != "/health" and not self.host.authorized(headers.get("authorization", ""), query):
            return _FORBIDDEN
        return await self.host.routes.get(path)

    async def _docs(
        self, path: str, headers: dict[str, str], query: dict[str, list[str]]
    ) -> HttpResponse | _Page:
        if not self.host.authorized(headers.get("authorization", ""), query):
            return _FORBIDDEN
        if path == "/openapi.json":
            if self._openapi is None:
                known = await self.host.routes.get("/schema")  # builds an env if need be
                if known.status != 200:
                    return known
                types = self.host.pool.types
                assert types is not None
                routes = self.host.routes
                self._openapi = openapi_document(types, self.host.pool.env_name, routes.serves)
            return HttpResponse(200, self._openapi)
        token = query.get("token", [""])[0]
        spec = "/openapi.json" + (f"?token={token}" if token else "")
        title = f"{self.host.pool.env_name} - OpenEnv Environment HTTP API"
        return _Page(swagger_html(spec, title) if path == "/docs" else redoc_html(spec, title))

    # -- WebSocket ---------------------------------------------------------------------------

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"].rstrip("/")
        raw_query = scope.get("query_string", b"").decode("latin-1")
        query = parse_qs(raw_query)
        headers = _headers(scope)
        connect = await receive()
        if connect["type"] != "websocket.connect":
            return
        if not self.host.authorized(headers.get("authorization", ""), query) or not (
            path in ("/ws", "/mcp")
            or (path == HARNESS_PATH and await self.host.harness.serves(self.host.routes.mode))
        ):
            # refused before the handshake: the ASGI server answers 403
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "websocket.accept"})
        request = _Request(path + ("?" + raw_query if raw_query else ""), headers)
        ws = AsgiWebSocket(receive, send, request, scope.get("client"))
        try:
            if path == "/mcp":
                await self.host.routes.serve_mcp_socket(ws)
            elif path == HARNESS_PATH:
                await self.host.harness.serve_socket(ws)
            else:
                # the session code reads what AsgiWebSocket has of a websockets ServerConnection
                await self.host.handle(cast(Any, ws))
        except ConnectionClosed:
            pass
        finally:
            await ws.close(1000)


@dataclass(frozen=True)
class _Page:
    html: str


@dataclass(frozen=True)
class _Request:
    """What the session code reads of a handshake request: its path and headers."""

    path: str
    headers: dict[str, str]


class AsgiWebSocket:
    """An accepted ASGI websocket, with what :class:`SessionHost` calls on a ``websockets``
    ``ServerConnection``: ``request.path``, ``remote_address``, ``recv()``, ``send()`` and
    ``close()``, each raising ``ConnectionClosed`` once the connection is closed.

    ``close()`` may come from another task than the one waiting in ``recv()`` (the idle
    watchdog); that ``recv()`` then raises at once.
    """

    def __init__(self, receive: Receive, send: Send, request: _Request, client: Any = None) -> None:
        self._receive = receive
        self._send = send
        self.request = request
        self.remote_address = tuple(client) if client else None
        self._closed: Close | None = None  # the close, once sent or received
        self._close_sent = False
        self._peer_closed = False
        self._closing = asyncio.get_running_loop().create_future()

    async def recv(self) -> str | bytes:
        """The next message, text or bytes."""
        if self._closed is not None:
            raise self._error()
        receiving = asyncio.ensure_future(self._receive())
        done, _ = await asyncio.wait(
            (receiving, self._closing), return_when=asyncio.FIRST_COMPLETED
        )
        if receiving not in done:
            receiving.cancel()
            raise self._error()
        message = receiving.result()
        if message["type"] == "websocket.receive":
            text = message.get("text")
            if text is not None:
                return str(text)
            return bytes(message.get("bytes") or b"")
        code = int(message.get("code", 1005))
        self._peer_closed = True
        self._mark_closed(Close(code, str(message.get("reason") or "")))
        raise self._error()

    async def send(self, message: str | bytes) -> None:
        """Send one text (``str``) or binary frame."""
        if self._closed is not None:
            raise self._error()
        frame: Message = {"type": "websocket.send"}
        frame["text" if isinstance(message, str) else "bytes"] = message
        try:
            await self._send(frame)
        except (OSError, RuntimeError) as exc:  # the ASGI server's "client went away"
            self._mark_closed(Close(1006, ""))
            raise self._error() from exc

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Close the connection (idempotent)."""
        if self._close_sent or self._peer_closed:
            return
        self._close_sent = True
        if self._closed is None:
            self._mark_closed(Close(code, reason))
        with contextlib.suppress(OSError, RuntimeError):
            await self._send({"type": "websocket.close", "code": code, "reason": reason})

    def _mark_closed(self, close: Close) -> None:
        self._closed = close
        if not self._closing.done():
            self._closing.set_result(None)

    def _error(self) -> ConnectionClosed:
        close = self._closed
        if close is not None and close.code in (1000, 1001):
            return ConnectionClosedOK(close, None)
        return ConnectionClosedError(close, None)


# -- helpers ---------------------------------------------------------------------------------


def _headers(scope: Scope) -> dict[str, str]:
    return {
        bytes(k).decode("latin-1").lower(): bytes(v).decode("latin-1")
        for k, v in scope.get("headers", [])
    }


async def _read_body(
    receive: Receive, headers: dict[str, str], limit: int
) -> tuple[bytes | None, HttpResponse | None]:
    """The request body (None if the client left first), or the refusal of one over
    ``limit`` bytes (413)."""
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return b"", HttpResponse(413, {"detail": f"Body of {declared} bytes exceeds {limit}"})
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None, None
        chunk = bytes(message.get("body", b""))
        size += len(chunk)
        if size > limit:
            return b"", HttpResponse(413, {"detail": f"Body exceeds {limit} bytes"})
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), None


_FORBIDDEN = HttpResponse(HTTPStatus.FORBIDDEN, {"detail": "missing or wrong token"})
