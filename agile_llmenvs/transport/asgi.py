"""A lean ASGI app serving OpenEnv's ``/ws`` protocol: one env per WebSocket session.

It speaks exactly OpenEnv's wire format (OpenEnv's own client drives it), without the web
framework layers between the socket and the env. Sync env calls run in a shared thread pool so
a slow env never stalls other sessions or the keep-alive pings; envs that implement OpenEnv's
``reset_async`` / ``step_async`` are awaited directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import json
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import parse_qs

from agile_llmenvs.transport._openenv import Environment, deserialize_action
from agile_llmenvs.transport.protocol import (
    ErrorCode,
    WireError,
    code_for_exception,
    error_frame,
    observation_frame,
    parse_message,
    state_frame,
)
from agile_llmenvs.transport.types import TextAction

__all__ = ["EnvApp", "ServerSettings"]

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class ServerSettings:
    """Settings of an env server beyond what to serve and where.

    Attributes:
        session_idle_timeout_s: A session that sends nothing for this long is closed (None:
            never). Long, so slow generations are safe; half-open peers are found sooner by
            the keep-alive ping.
        ws_ping_interval_s: Seconds between keep-alive pings (None: no pings).
        ws_ping_timeout_s: A peer that does not answer a ping within this is dropped.
        max_message_bytes: Larger frames get a ``MESSAGE_TOO_LARGE`` error reply.
        executor_threads: Threads running sync env calls (None: one per session, up to 256).
    """

    session_idle_timeout_s: float | None = 1800.0
    ws_ping_interval_s: float | None = 20.0
    ws_ping_timeout_s: float | None = 20.0
    max_message_bytes: int = 8 * 1024 * 1024
    executor_threads: int | None = None


class EnvApp:
    """The ASGI application: ``/ws`` sessions, ``GET /health`` and ``GET /metadata``.

    Args:
        make_env: Builds the OpenEnv ``Environment`` of one session.
        env_name: Name reported by ``/metadata``.
        max_sessions: Live sessions allowed at once (None: unlimited).
        token: Shared secret a client must present (``Authorization: Bearer``, or ``?token=``).
        settings: Timeouts and limits.
        owns_envs: Close each session's env when the session ends (False for a shared env).
    """

    def __init__(
        self,
        make_env: Callable[[], Environment],
        *,
        env_name: str,
        max_sessions: int | None,
        token: str | None,
        settings: ServerSettings,
        owns_envs: bool = True,
    ) -> None:
        self.make_env = make_env
        self.owns_envs = owns_envs
        self.env_name = env_name
        self.max_sessions = max_sessions
        self.token = token
        self.settings = settings
        self.active_sessions = 0
        threads = settings.executor_threads or min(max_sessions or 256, 256)
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="env-session")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "websocket":
            await self._websocket(scope, receive, send)
        elif kind == "http":
            await self._http(scope, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    # -- sessions ----------------------------------------------------------------------------

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        if scope["path"].rstrip("/") != "/ws" or not self._authorized(scope):
            await send({"type": "websocket.close", "code": 1008})  # refused: HTTP 403
            return
        await send({"type": "websocket.accept"})
        if self.max_sessions is not None and self.active_sessions >= self.max_sessions:
            message = f"Server at capacity ({self.active_sessions}/{self.max_sessions} sessions)"
            await _send_quietly(
                send,
                error_frame(
                    ErrorCode.CAPACITY_REACHED,
                    message,
                    active_sessions=self.active_sessions,
                    max_sessions=self.max_sessions,
                ),
            )
            await _close_quietly(send, 1013)
            return
        self.active_sessions += 1
        try:
            await self._session(receive, send)
        finally:
            self.active_sessions -= 1

    async def _session(self, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        try:
            env = await loop.run_in_executor(self.executor, self.make_env)
        except Exception as exc:
            logger.exception("env factory failed")
            await _send_quietly(
                send,
                error_frame(
                    ErrorCode.FACTORY_ERROR,
                    f"{type(exc).__name__}: {exc}",
                    error_type=type(exc).__name__,
                ),
            )
            await _close_quietly(send, 1011)
            return
        action_cls = getattr(env, "ACTION_CLS", None) or TextAction
        try:
            await self._serve(env, action_cls, receive, send)
        except OSError:  # the peer vanished while we were sending
            pass
        finally:
            if self.owns_envs:
                with contextlib.suppress(Exception):
                    await loop.run_in_executor(self.executor, env.close)

    async def _serve(
        self, env: Environment, action_cls: type, receive: Receive, send: Send
    ) -> None:
        idle = self.settings.session_idle_timeout_s
        while True:
            try:
                async with asyncio.timeout(idle):
                    event = await receive()
            except TimeoutError:
                await _close_quietly(send, 1001, "session idle timeout")
                return
            if event["type"] == "websocket.disconnect":
                return
            text: str | None = event.get("text")
            reply: str | None
            if text is None:
                reply = error_frame(
                    ErrorCode.VALIDATION_ERROR, "Binary frames are not supported; send JSON text"
                )
            elif len(text) > self.settings.max_message_bytes:
                reply = error_frame(
                    ErrorCode.MESSAGE_TOO_LARGE,
                    f"Message of {len(text)} bytes exceeds the server's limit of "
                    f"{self.settings.max_message_bytes}",
                )
            else:
                reply = await self._reply(env, action_cls, text)
                if reply is None:  # a close message
                    await _close_quietly(send, 1000)
                    return
            await send({"type": "websocket.send", "text": reply})

    async def _reply(self, env: Environment, action_cls: type, text: str) -> str | None:
        try:
            message = parse_message(text)
            if message.type == "close":
                return None
            if message.type == "state":
                return state_frame(env.state)
            if message.type == "reset":
                observation = await self._call(env, "reset", **_reset_kwargs(env, message.data))
            else:
                action = deserialize_action(message.data, action_cls)
                observation = await self._call(env, "step", action)
            return observation_frame(observation)
        except WireError as exc:
            return error_frame(exc.code, str(exc), **exc.extra)
        except Exception as exc:
            return error_frame(
                code_for_exception(exc),
                f"{type(exc).__name__}: {exc}",
                error_type=type(exc).__name__,
            )

    async def _call(self, env: Environment, method: str, *args: Any, **kwargs: Any) -> Any:
        native = getattr(env, f"{method}_async")
        if getattr(type(env), f"{method}_async") is not getattr(Environment, f"{method}_async"):
            return await native(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.executor, partial(getattr(env, method), *args, **kwargs)
        )

    def _authorized(self, scope: Scope) -> bool:
        if self.token is None:
            return True
        presented = ""
        for name, value in scope.get("headers", []):
            if name == b"authorization" and value.startswith(b"Bearer "):
                presented = value[7:].decode("latin-1")
        if not presented:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            presented = query.get("token", [""])[0]
        return hmac.compare_digest(presented.encode(), self.token.encode())

    # -- plain HTTP --------------------------------------------------------------------------

    async def _http(self, scope: Scope, send: Send) -> None:
        path = scope["path"].rstrip("/")
        if scope["method"] == "GET" and path == "/health":
            await _json_response(send, 200, {"status": "healthy"})
        elif scope["method"] == "GET" and path == "/metadata":
            await _json_response(
                send,
                200,
                {
                    "name": self.env_name,
                    "active_sessions": self.active_sessions,
                    "max_sessions": self.max_sessions,
                },
            )
        else:
            await _json_response(send, 404, {"detail": "Not Found"})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            event = await receive()
            if event["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif event["type"] == "lifespan.shutdown":
                self.executor.shutdown(wait=False, cancel_futures=True)
                await send({"type": "lifespan.shutdown.complete"})
                return


_SIGNATURES: dict[type, inspect.Signature] = {}


def _reset_kwargs(env: Environment, data: dict[str, Any]) -> dict[str, Any]:
    """Drop reset kwargs the env cannot take, as OpenEnv does."""
    cls = type(env)
    if cls not in _SIGNATURES:
        _SIGNATURES[cls] = inspect.signature(env.reset)
    params = _SIGNATURES[cls].parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return data
    return {k: v for k, v in data.items() if k in params}


async def _send_quietly(send: Send, text: str) -> None:
    with contextlib.suppress(OSError, RuntimeError):
        await send({"type": "websocket.send", "text": text})


async def _close_quietly(send: Send, code: int, reason: str = "") -> None:
    with contextlib.suppress(OSError, RuntimeError):
        await send({"type": "websocket.close", "code": code, "reason": reason})


async def _json_response(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
