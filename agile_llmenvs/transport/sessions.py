"""Serve OpenEnv's ``/ws`` protocol: one env per WebSocket session.

It speaks exactly OpenEnv's wire format (OpenEnv's own client drives it) on the ``websockets``
library's asyncio server, with no web framework between the socket and the env. Env calls
run where :class:`~agile_llmenvs.transport.env_calls.EnvCalls` runs them; the envs and the
capacity are the :class:`~agile_llmenvs.transport.env_pool.EnvPool`'s; plain HTTP routes are
:class:`~agile_llmenvs.transport.routes.HttpRoutes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import uuid
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

from pydantic import ValidationError
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from agile_llmenvs.transport._openenv import Environment, deserialize_action
from agile_llmenvs.transport.env_calls import Discard
from agile_llmenvs.transport.env_pool import EnvPool
from agile_llmenvs.transport.env_types import EnvTypes
from agile_llmenvs.transport.harness_route import HARNESS_PATH, HarnessRoute
from agile_llmenvs.transport.http import SERVER_ERROR, HttpRequest, HttpResponse
from agile_llmenvs.transport.idle import IdleClock, close_when_idle
from agile_llmenvs.transport.mcp import parse_rpc
from agile_llmenvs.transport.mcp_sessions import open_mcp_session
from agile_llmenvs.transport.protocol import (
    ErrorCode,
    WireError,
    code_for_exception,
    error_frame,
    exception_location,
    observation_frame,
    parse_message,
    state_frame,
    validation_errors,
)
from agile_llmenvs.transport.routes import HttpRoutes
from agile_llmenvs.transport.settings import ServerSettings
from agile_llmenvs.transport.types import TextAction
from agile_llmenvs.transport.wrapper import OpenEnvWrapper

__all__ = ["ServerSettings", "SessionHost"]

logger = logging.getLogger(__name__)


class SessionHost:
    """Runs ``/ws`` sessions, and answers the HTTP routes (:class:`HttpRoutes`).

    Every env it serves comes from ``pool``, under the pool's one capacity: a ``/ws`` session
    holds a slot from its first valid message to its env's close. When the pool is full, a
    new session is refused at once (``CAPACITY_REACHED``, HTTP 503), after idle MCP sessions
    are reaped.

    Args:
        pool: The server's envs, their calls and its capacity.
        token: Shared secret a client must present (``Authorization: Bearer``, or ``?token=``)
            on every route but ``/health``.
    """

    def __init__(self, pool: EnvPool, *, token: str | None) -> None:
        self.pool = pool
        self.settings = pool.settings
        self.token = token
        self.routes = HttpRoutes(pool)
        self.harness = HarnessRoute(pool)
        if token is not None and not token:
            raise ValueError(
                "token is empty: an empty token would accept every client; pass a secret, or "
                "token=None to serve without authentication"
            )

    # -- handshake ---------------------------------------------------------------------------

    async def process_request(
        self, connection: ServerConnection, request: Request
    ) -> Response | None:
        """Answer ``GET`` routes and refuse unauthorised or misrouted sessions."""
        path = urlsplit(request.path).path.rstrip("/")
        query = parse_qs(urlsplit(request.path).query)
        if path != "/health" and not self.authorized(
            request.headers.get("Authorization", ""), query
        ):
            return _response(_FORBIDDEN)
        if path == "/ws" or (path == "/mcp" and _is_upgrade(request)):
            return None
        if path == HARNESS_PATH and _is_upgrade(request):
            # an unserved /harness is refused as create_app's router refuses it
            return None if await self.harness.serves(self.routes.mode) else _response(_NO_ROUTE)
        try:
            answer = await self.routes.get(path)
        except Exception:
            logger.exception("GET %s failed", path)
            answer = SERVER_ERROR
        return _response(answer)

    async def answer_http(self, request: HttpRequest) -> HttpResponse:
        """Answer a plain HTTP request: ``POST /reset``, ``/step``, ``/mcp`` (and a ``GET``
        that carries a body)."""
        if request.method == "GET" and request.path.rstrip("/") == "/health":
            return await self.routes.get("/health")
        if not self.authorized(request.headers.get("authorization", ""), request.query):
            return _FORBIDDEN
        if request.method == "GET":  # one with a body, which websockets does not read
            return await self.routes.get(request.path.rstrip("/"))
        return await self.routes.post(request)

    def gate(
        self, path: str, headers: dict[str, str], query: dict[str, list[str]]
    ) -> HttpResponse | None:
        """Refuse a plain HTTP request at its headers when its token is missing or wrong
        (``/health`` is open): its body is then never read."""
        if path.rstrip("/") == "/health" or self.authorized(
            headers.get("authorization", ""), query
        ):
            return None
        return _FORBIDDEN

    def authorized(self, authorization: str, query: dict[str, list[str]]) -> bool:
        """Whether a request may pass: no token is set, or it presents the token (an
        ``Authorization: Bearer`` header, else a ``token`` query parameter)."""
        if self.token is None:
            return True
        presented = authorization[7:] if authorization.startswith("Bearer ") else ""
        if not presented:
            presented = query.get("token", [""])[0]
        return hmac.compare_digest(presented.encode(), self.token.encode())

    # -- capacity ----------------------------------------------------------------------------

    async def _refuse(self, ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            await ws.send(
                error_frame(
                    ErrorCode.CAPACITY_REACHED,
                    self.pool.capacity_message(),
                    active_sessions=self.pool.active_sessions,
                    max_sessions=self.pool.max_sessions,
                )
            )
            await ws.close(1013, "at capacity")

    # -- sessions ----------------------------------------------------------------------------

    async def handle(self, ws: ServerConnection) -> None:
        """Serve one connection: at ``/ws``, one env from its first valid message to its
        close; at ``/mcp``, an MCP session for the connection's life
        (:meth:`HttpRoutes.serve_mcp_socket`); at ``/harness``, a harness session
        (:meth:`HarnessRoute.serve_socket`)."""
        path = ws.request.path if ws.request is not None else ""
        if urlsplit(path).path.rstrip("/") == "/mcp":
            with contextlib.suppress(ConnectionClosed, Discard):
                await self.routes.serve_mcp_socket(ws)
            return
        if urlsplit(path).path.rstrip("/") == HARNESS_PATH:
            with contextlib.suppress(ConnectionClosed):
                await self.harness.serve_socket(ws)
            return
        session_id = parse_qs(urlsplit(path).query).get("session_id", [""])[0]
        if session_id:  # a session made over HTTP (OpenEnv's MCPToolClient): counted already
            await self._attached_session(ws, session_id)
            return
        pool = self.pool
        if pool.full():  # told right after the handshake, as OpenEnv does
            await pool.reap_idle()
            if pool.full():
                await self._refuse(ws)
                return
        first = await self._first_message(ws)
        if first is None:
            return
        if not await pool.take_slot():
            await self._refuse(ws)
            return
        try:
            await self._session(ws, first)
        finally:
            pool.free_slot()

    async def _first_message(self, ws: ServerConnection) -> Any:
        """The connection's first valid message (invalid ones are answered with their
        error); None once it closes, sends ``close``, or sends nothing valid within
        ``first_message_timeout_s`` (closed with 1008)."""
        timeout = self.settings.first_message_timeout_s
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            left = None if deadline is None else max(deadline - loop.time(), 0.0)
            try:
                message = await asyncio.wait_for(ws.recv(), left)
            except TimeoutError:
                with contextlib.suppress(ConnectionClosed):
                    await ws.close(1008, "no valid message within first_message_timeout_s")
                return None
            except ConnectionClosed:
                return None
            error = self._invalid(message)
            if error is None:
                return message
            if error == "close":
                with contextlib.suppress(ConnectionClosed):
                    await ws.close(1000)
                return None
            try:
                await ws.send(error)
            except ConnectionClosed:
                return None

    def _invalid(self, message: Any) -> str | None:
        """The error reply to a message no env needs to see (``close`` for a close
        message), or None for a message that needs an env."""
        if not isinstance(message, str):
            return error_frame(
                ErrorCode.VALIDATION_ERROR, "Binary frames are not supported; send JSON text"
            )
        limit = self.settings.max_message_bytes
        if len(message) > limit:
            return error_frame(
                ErrorCode.MESSAGE_TOO_LARGE,
                f"Message of {len(message)} bytes exceeds the server's limit of {limit}",
            )
        try:
            kind, _ = parse_message(message)
        except WireError as exc:
            return error_frame(exc.code, str(exc), **exc.extra)
        return "close" if kind == "close" else None

    async def _attached_session(self, ws: ServerConnection, session_id: str) -> None:
        try:
            session = self.pool.attach(session_id)
        except RuntimeError as exc:
            with contextlib.suppress(ConnectionClosed):
                await ws.send(error_frame(ErrorCode.SESSION_ERROR, str(exc)))
                await ws.close(1000)
            return
        try:
            await self._serve(ws, session.env, self.pool.types_of(session.env), None, session_id)
        except (ConnectionClosed, Discard):
            pass
        finally:
            await self.pool.detach(session_id)

    async def _session(self, ws: ServerConnection, first: str) -> None:
        try:
            env = await self.pool.env_calls.call_bounded(self.pool.make_env)
        except (Exception, Discard) as exc:
            failed = exc.exc if isinstance(exc, Discard) else exc
            logger.error("env factory failed: %s: %s", type(failed).__name__, failed)
            await _fail_session(ws, ErrorCode.FACTORY_ERROR, failed, "env factory failed")
            return
        types = self.pool.types_of(env)
        discarded = False
        try:
            async with contextlib.AsyncExitStack() as stack:
                await open_mcp_session(env, stack)
                # the session's own id, as OpenEnv gives every /ws session one
                await self._serve(ws, env, types, first, str(uuid.uuid4()))
        except ConnectionClosed:
            pass
        except Discard as failure:
            discarded = True
            await _fail_session(ws, ErrorCode.EXECUTION_ERROR, failure.exc, "env discarded")
        finally:
            if self.pool.owns_envs or discarded:
                with contextlib.suppress(BaseException):
                    await self.pool.env_calls.call_bounded(env.close)

    async def _serve(
        self,
        ws: ServerConnection,
        env: Environment,
        types: EnvTypes,
        first: Any,
        session_id: str,
    ) -> None:
        idle = self.settings.session_idle_timeout_s
        limit = self.settings.max_message_bytes
        loop = asyncio.get_running_loop()
        clock = IdleClock(loop.time())
        watchdog = None if idle is None else asyncio.create_task(close_when_idle(ws, clock, idle))
        message = first
        try:
            while True:
                if message is None:
                    message = await ws.recv()
                clock.busy = True
                if not isinstance(message, str):
                    reply = error_frame(
                        ErrorCode.VALIDATION_ERROR,
                        "Binary frames are not supported; send JSON text",
                    )
                elif len(message) > limit:
                    reply = error_frame(
                        ErrorCode.MESSAGE_TOO_LARGE,
                        f"Message of {len(message)} bytes exceeds the server's limit of {limit}",
                    )
                else:
                    answer = await self._reply(env, types, message, session_id)
                    if answer is None:  # a close message
                        await ws.close(1000)
                        return
                    reply = answer
                await ws.send(reply)
                message = None
                clock.busy = False
                clock.last = loop.time()
        finally:
            if watchdog is not None:
                watchdog.cancel()

    async def _reply(
        self, env: Environment, types: EnvTypes, text: str, session_id: str
    ) -> str | None:
        try:
            kind, data = parse_message(text)
            if kind == "close":
                return None
            if kind == "state":  # a property, yet env code: off the loop and bounded
                return state_frame(await self.pool.state(env))
            if kind == "reset":
                observation = await self.pool.reset(env, data)
            elif kind == "mcp":
                return await self._mcp(env, data, session_id)
            elif _plain_text_step(env, types, data):  # nearly every step of a hosted text env
                frame: str = await self.pool.env_calls.call(env, "step_frame", data["message"])
                return frame
            else:
                try:
                    action = deserialize_action(data, types.action)
                except ValidationError as exc:  # OpenEnv's reply, word for word
                    return error_frame(
                        ErrorCode.VALIDATION_ERROR, "Invalid message", errors=validation_errors(exc)
                    )
                observation = await self.pool.step(env, action)
            return observation_frame(observation)
        except WireError as exc:
            return error_frame(exc.code, str(exc), **exc.extra)
        except Discard:
            raise
        except Exception as exc:
            location = exception_location(exc)  # the env author's file and line
            return error_frame(
                code_for_exception(exc),
                f"{type(exc).__name__}: {exc}",
                error_type=type(exc).__name__,
                **({"location": location} if location else {}),
            )

    async def _mcp(self, env: Environment, data: dict[str, Any], session_id: str) -> str:
        """The ``mcp`` reply to one JSON-RPC request within the session ``session_id``."""
        request, reply = parse_rpc(data)
        if request is not None:
            reply = await self.routes.mcp(request, env, session_id)
        return json.dumps({"type": "mcp", "data": reply})


async def _fail_session(
    ws: ServerConnection, code: ErrorCode, exc: BaseException, reason: str
) -> None:
    """Tell the client why its session ends, then close it (1011)."""
    with contextlib.suppress(ConnectionClosed):
        await ws.send(
            error_frame(code, f"{type(exc).__name__}: {exc}", error_type=type(exc).__name__)
        )
        await ws.close(1011, reason)


def _plain_text_step(env: Environment, types: EnvTypes, data: dict[str, Any]) -> bool:
    """Whether this step can skip the action and observation models: our own wrapper with
    its own action class, its steps not overridden, and ``data`` exactly a valid
    :class:`TextAction`."""
    return (
        isinstance(env, OpenEnvWrapper)
        and types.action is TextAction
        and env.takes_text_directly()
        and len(data) == 1
        and type(data.get("message")) is str
    )


_FORBIDDEN = HttpResponse(HTTPStatus.FORBIDDEN, {"detail": "missing or wrong token"})
#: A WebSocket to a path with no route, as uvicorn answers one for create_app: 403, no body.
_NO_ROUTE = HttpResponse(HTTPStatus.FORBIDDEN, "", text=True)


def _is_upgrade(request: Request) -> bool:
    """Whether ``request`` asks for a WebSocket (a plain ``GET /mcp`` is answered 405)."""
    return "websocket" in request.headers.get("Upgrade", "").lower()


def _response(answer: HttpResponse) -> Response:
    """``answer`` as the response ``websockets`` sends instead of a handshake. ``websockets``
    closes the connection after it, so it says ``Connection: close``: a keep-alive client
    (httpx, a requests session) would otherwise send its next request on the closing
    connection and read "Server disconnected"."""
    payload = answer.payload()
    headers = Headers(
        [
            ("Content-Type", answer.content_type),
            ("Content-Length", str(len(payload))),
            ("Connection", "close"),
        ]
    )
    return Response(answer.status, HTTPStatus(answer.status).phrase, headers, payload)
