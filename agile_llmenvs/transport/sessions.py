"""Serve OpenEnv's ``/ws`` protocol: one env per WebSocket session.

It speaks exactly OpenEnv's wire format (OpenEnv's own client drives it) on the ``websockets``
library's asyncio server, with no web framework between the socket and the env. Sync env
calls run where :class:`~agile_llmenvs.transport.calls.CallPolicy` says (a shared thread pool,
or inline once an env has shown its calls are fast); envs implementing OpenEnv's
``reset_async`` / ``step_async`` are awaited directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from agile_llmenvs.transport._openenv import Environment, deserialize_action
from agile_llmenvs.transport.calls import CallMode, CallPolicy
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
from agile_llmenvs.transport.wrapper import OpenEnvWrapper

__all__ = ["ServerSettings", "SessionHost"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    """Settings of an env server beyond what to serve and where.

    Attributes:
        session_idle_timeout_s: A session that sends nothing for this long is closed (None:
            never). Long, so slow generations are safe; half-open peers are found sooner by
            the keep-alive ping.
        ws_ping_interval_s: Seconds between keep-alive pings (None: no pings).
        ws_ping_timeout_s: A peer that does not answer a ping within this is dropped.
        max_message_bytes: Larger frames get a ``MESSAGE_TOO_LARGE`` error reply; frames over
            4x this close the connection (code 1009).
        executor_threads: Threads running sync env calls (None: one per session, up to 256).
        env_calls: Where sync env calls run: ``auto`` (in the thread pool until an env class
            has shown its calls are fast, then inline on the event loop; see
            :mod:`~agile_llmenvs.transport.calls`), ``thread`` or ``inline``.
    """

    session_idle_timeout_s: float | None = 1800.0
    ws_ping_interval_s: float | None = 20.0
    ws_ping_timeout_s: float | None = 20.0
    max_message_bytes: int = 8 * 1024 * 1024
    executor_threads: int | None = None
    env_calls: CallMode = "auto"


class SessionHost:
    """Runs ``/ws`` sessions (and answers ``GET /health`` and ``GET /metadata``).

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
        self.env_name = env_name
        self.max_sessions = max_sessions
        self.token = token
        self.settings = settings
        self.owns_envs = owns_envs
        self.active_sessions = 0
        threads = settings.executor_threads or min(max_sessions or 256, 256)
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="env-session")
        self.calls = CallPolicy(settings.env_calls)

    # -- handshake ---------------------------------------------------------------------------

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        """Answer plain HTTP requests and refuse unauthorised or misrouted sessions."""
        path = urlsplit(request.path).path.rstrip("/")
        if path == "/health":
            return _json_response(HTTPStatus.OK, {"status": "healthy"})
        if path == "/metadata":
            return _json_response(
                HTTPStatus.OK,
                {
                    "name": self.env_name,
                    "active_sessions": self.active_sessions,
                    "max_sessions": self.max_sessions,
                },
            )
        if path != "/ws":
            return _json_response(HTTPStatus.NOT_FOUND, {"detail": "Not Found"})
        if not self._authorized(request):
            return _json_response(HTTPStatus.FORBIDDEN, {"detail": "missing or wrong token"})
        return None

    def _authorized(self, request: Request) -> bool:
        if self.token is None:
            return True
        presented = request.headers.get("Authorization", "")
        presented = presented[7:] if presented.startswith("Bearer ") else ""
        if not presented:
            presented = parse_qs(urlsplit(request.path).query).get("token", [""])[0]
        return hmac.compare_digest(presented.encode(), self.token.encode())

    # -- sessions ----------------------------------------------------------------------------

    async def handle(self, ws: ServerConnection) -> None:
        """Serve one connection: one env, from its first message to its close."""
        if self.max_sessions is not None and self.active_sessions >= self.max_sessions:
            message = f"Server at capacity ({self.active_sessions}/{self.max_sessions} sessions)"
            with contextlib.suppress(ConnectionClosed):
                await ws.send(
                    error_frame(
                        ErrorCode.CAPACITY_REACHED,
                        message,
                        active_sessions=self.active_sessions,
                        max_sessions=self.max_sessions,
                    )
                )
                await ws.close(1013, "at capacity")
            return
        self.active_sessions += 1
        try:
            await self._session(ws)
        finally:
            self.active_sessions -= 1

    async def _session(self, ws: ServerConnection) -> None:
        loop = asyncio.get_running_loop()
        try:
            env = await loop.run_in_executor(self.executor, self.make_env)
        except Exception as exc:
            logger.exception("env factory failed")
            with contextlib.suppress(ConnectionClosed):
                await ws.send(
                    error_frame(
                        ErrorCode.FACTORY_ERROR,
                        f"{type(exc).__name__}: {exc}",
                        error_type=type(exc).__name__,
                    )
                )
                await ws.close(1011, "env factory failed")
            return
        action_cls = getattr(env, "ACTION_CLS", None) or TextAction
        try:
            await self._serve(ws, env, action_cls)
        except ConnectionClosed:
            pass
        finally:
            if self.owns_envs:
                with contextlib.suppress(Exception):
                    await loop.run_in_executor(self.executor, env.close)

    async def _serve(self, ws: ServerConnection, env: Environment, action_cls: type) -> None:
        idle = self.settings.session_idle_timeout_s
        limit = self.settings.max_message_bytes
        loop = asyncio.get_running_loop()
        clock = _IdleClock(loop.time())
        watchdog = None if idle is None else asyncio.create_task(_close_when_idle(ws, clock, idle))
        try:
            while True:
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
                    answer = await self._reply(env, action_cls, message)
                    if answer is None:  # a close message
                        await ws.close(1000)
                        return
                    reply = answer
                await ws.send(reply)
                clock.busy = False
                clock.last = loop.time()
        finally:
            if watchdog is not None:
                watchdog.cancel()

    async def _reply(self, env: Environment, action_cls: type, text: str) -> str | None:
        try:
            kind, data = parse_message(text)
            if kind == "close":
                return None
            if kind == "state":
                return state_frame(env.state)
            if kind == "reset":
                observation = await self._call(env, "reset", **_reset_kwargs(env, data))
            elif _plain_text_step(env, data):  # nearly every step of a hosted text env
                frame: str = await self._call(env, "step_frame", data["message"])
                return frame
            else:
                action = deserialize_action(data, action_cls)
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
        env_class = type(env)
        overridden = getattr(env_class, f"{method}_async", None)
        if overridden is not None and overridden is not getattr(Environment, f"{method}_async"):
            return await getattr(env, f"{method}_async")(*args, **kwargs)
        call = partial(getattr(env, method), *args, **kwargs)
        inline = self.calls.inline(env_class)
        if inline:
            return self._timed(env_class, call, inline=True)
        timed = partial(self._timed, env_class, call, inline=False)
        return await asyncio.get_running_loop().run_in_executor(self.executor, timed)

    def _timed(self, env_class: type, call: Callable[[], Any], *, inline: bool) -> Any:
        """Run ``call`` and report its own duration (never the wait for a worker thread,
        which grows with the number of sessions, not with the env's cost)."""
        start = time.perf_counter()
        try:
            return call()
        finally:
            self.calls.record(env_class, time.perf_counter() - start, inline=inline)


def _plain_text_step(env: Environment, data: dict[str, Any]) -> bool:
    """Whether this step can skip the action and observation models: our own wrapper, its
    steps not overridden, and ``data`` exactly a valid :class:`TextAction`."""
    return (
        isinstance(env, OpenEnvWrapper)
        and env.takes_text_directly()
        and len(data) == 1
        and type(data.get("message")) is str
    )


class _IdleClock:
    """What the idle watchdog reads: when the last reply went, and whether a call runs."""

    __slots__ = ("busy", "last")

    def __init__(self, now: float) -> None:
        self.busy = False
        self.last = now


async def _close_when_idle(ws: ServerConnection, clock: _IdleClock, idle_s: float) -> None:
    """Close the session once ``idle_s`` passes with no message and no call running.

    A timer per session that sleeps until the deadline, instead of a timeout armed on every
    receive (which cost ~7% of the server's time per step under load).
    """
    loop = asyncio.get_running_loop()
    while True:
        left = idle_s if clock.busy else clock.last + idle_s - loop.time()
        if left <= 0:
            await ws.close(1001, "session idle timeout")
            return
        await asyncio.sleep(left)


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


def _json_response(status: HTTPStatus, body: dict[str, Any]) -> Response:
    payload = json.dumps(body).encode()
    headers = Headers([("Content-Type", "application/json"), ("Content-Length", str(len(payload)))])
    return Response(status.value, status.phrase, headers, payload)
