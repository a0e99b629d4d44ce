"""RemoteEnvClient: one OpenEnv ``/ws`` session, i.e. one env instance behind a URL."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import Any, cast

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException
from websockets.sync.client import ClientConnection as SyncClientConnection
from websockets.sync.client import connect as sync_connect

from agile_llmenvs import _json
from agile_llmenvs.errors import (
    EnvAuthError,
    EnvCapacityError,
    EnvConnectionError,
    EnvError,
    EnvFactoryError,
    EnvProtocolError,
    EnvStateError,
    EnvTimeoutError,
)
from agile_llmenvs.transport.protocol import error_from_wire, strict_json_loads
from agile_llmenvs.transport.session_loop import SESSION_LOOP
from agile_llmenvs.transport.types import EnvReply

__all__ = ["ClientState", "RemoteEnvClient", "ws_url"]

_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_LIST_TOOLS = {"type": "list_tools"}  # OpenEnv's MCP step that lists an env's tools


class ClientState(Enum):
    """Lifecycle of a remote session."""

    IDLE = "idle"  # no connection yet
    READY = "ready"  # connected, no episode started
    IN_EPISODE = "in_episode"
    LOST = "lost"  # the connection failed mid-episode; the next reset reconnects
    CLOSED = "closed"


def ws_url(base_url: str) -> str:
    """The ``/ws`` URL of a server's base URL (``http(s)://`` or ``ws(s)://``)."""
    url = base_url.rstrip("/")
    for http, ws in (("http://", "ws://"), ("https://", "wss://")):
        if url.startswith(http):
            url = ws + url[len(http) :]
    if not url.startswith(("ws://", "wss://")):
        raise ValueError(f"expected an http(s):// or ws(s):// URL, got {base_url!r}")
    return url if url.endswith("/ws") else f"{url}/ws"


class RemoteEnvClient:
    """Drives an environment hosted behind a URL, over one WebSocket session.

    The session is the env instance: the server builds a fresh env when the connection opens
    and destroys it when it closes. A connection lost mid-episode therefore fails that episode
    with :class:`~agile_llmenvs.errors.EnvConnectionError` instead of silently continuing on a
    fresh env; reconnection (with jittered backoff) happens only at the next :meth:`reset`.
    A reply that misses ``timeout_s`` drops the session (:class:`EnvTimeoutError`), and so does
    a call interrupted while it waits (Ctrl-C, a cancelled task), so a late reply can never be
    taken as the answer to a later call.

    The blocking methods (:meth:`reset`, :meth:`step`, ...) send from the calling thread on a
    blocking connection whose own thread reads replies and answers keep-alive pings, so a
    session survives a caller that spends minutes generating. An open blocking session holds
    two threads (the reader and its keep-alive pinger); for thousands of sessions the async
    methods (:meth:`areset`, :meth:`astep`, ...) are lighter: they run on the process-wide
    session loop (:data:`~agile_llmenvs.transport.session_loop.SESSION_LOOP`). The first call
    of an episode picks the connection; the other API still works on it, through a thread hop.

    Args:
        base_url: Root URL of the env server, or a zero-argument callable returning it —
            called again on every reconnect, so a host that moved is found again.
        timeout_s: Per-message timeout (None: unbounded).
        connect_timeout_s: Time allowed to (re)establish the session, retries included.
        mcp_tool: If set, the text is sent as ``call_tool(mcp_tool, {action_field: text})``.
        action_field: Action field (or MCP argument name) carrying the text.
        tasks: Per-row reset kwargs; ``row_index`` selects the entry merged into reset.
        eval_tasks: Held-out per-row reset kwargs used in :meth:`eval_mode`.
        token: Shared secret the server requires, sent as ``Authorization: Bearer``.
    """

    def __init__(
        self,
        base_url: str | Callable[[], str],
        *,
        timeout_s: float | None = None,
        connect_timeout_s: float = 30.0,
        mcp_tool: str | None = None,
        action_field: str = "message",
        tasks: Sequence[Mapping[str, Any]] | None = None,
        eval_tasks: Sequence[Mapping[str, Any]] | None = None,
        token: str | None = None,
    ) -> None:
        if token is not None and not token:
            raise ValueError(
                "token is empty: it would send no credentials at all; pass the server's secret, "
                "or token=None for a server without authentication"
            )
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.mcp_tool = mcp_tool
        self.action_field = action_field
        self.tasks = list(tasks) if tasks is not None else None
        self.eval_tasks = list(eval_tasks) if eval_tasks is not None else None
        self.token = token
        self.eval = False
        self.state_ = ClientState.IDLE
        self.url = ""
        self._ws: ClientConnection | None = None  # async, on the session loop
        self._sync_ws: SyncClientConnection | None = None  # blocking, on the caller's thread
        self._lock: asyncio.Lock | None = None
        self._sync_lock = threading.Lock()

    # -- blocking API ------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, **task: Any) -> EnvReply:
        """Start an episode, (re)connecting first when needed."""
        if self._ws is not None:
            return SESSION_LOOP.run(self.areset(seed=seed, **task))
        with self._sync_lock:
            message = self._reset_message(seed, task)
            if self._sync_ws is None:
                self._connect_sync()
            reply = self._exchange_sync(message)
            self.state_ = ClientState.IN_EPISODE
            return reply

    def step(self, text: str) -> EnvReply:
        """Send the policy's text; returns the env's reply."""
        if self.mcp_tool is not None:
            return self.call_tool(self.mcp_tool, {self.action_field: text})
        return self._step_sync({self.action_field: text})

    def step_action(self, fields: Mapping[str, Any]) -> EnvReply:
        """Send an action given by its fields (what an ``action_parser`` made of the text)."""
        return self._step_sync(dict(fields))

    def call_tool(self, name: str, arguments: dict[str, Any]) -> EnvReply:
        """Call an MCP tool of the env (``call_tool`` as an OpenEnv step)."""
        return self._step_sync({"type": "call_tool", "tool_name": name, "arguments": arguments})

    def list_tools(self) -> list[dict[str, Any]]:
        """The env's MCP tools (``list_tools`` as an OpenEnv step, in an episode), each with
        ``name``, ``description`` and ``input_schema``.

        Raises:
            EnvProtocolError: the env is not an MCP env (it refused the step).
            EnvExecutionError: the env could not list its tools.
        """
        return self._step_sync(_LIST_TOOLS).listed_tools()

    def state(self) -> dict[str, Any]:
        """The env's OpenEnv state."""
        if self._ws is not None:
            return SESSION_LOOP.run(self.astate())
        with self._sync_lock:
            self._check_connected(self._sync_ws)
            return self._exchange_sync({"type": "state"}, parse=False)

    def close(self) -> None:
        """End the session (the server closes the env); idempotent."""
        if self._ws is not None:
            SESSION_LOOP.run(self.aclose())
            return
        with self._sync_lock:
            ws, self._sync_ws = self._sync_ws, None
            self.state_ = ClientState.CLOSED
            if ws is not None:
                with contextlib.suppress(Exception):
                    ws.send(json.dumps({"type": "close"}))
                with contextlib.suppress(Exception):
                    ws.close()

    def eval_mode(self) -> None:
        """Select reset kwargs from ``eval_tasks`` (when given) instead of ``tasks``."""
        self.eval = True

    def train_mode(self) -> None:
        """Select reset kwargs from ``tasks`` again."""
        self.eval = False

    def __enter__(self) -> RemoteEnvClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- async API (run on SESSION_LOOP) -------------------------------------------------------

    async def areset(self, *, seed: int | None = None, **task: Any) -> EnvReply:
        """Async :meth:`reset`; must run on the session loop."""
        if self._sync_ws is not None:
            return await asyncio.to_thread(lambda: self.reset(seed=seed, **task))
        async with self._guard():
            message = self._reset_message(seed, task)
            if self._ws is None:
                await self._connect()
            reply = await self._exchange(message)
            self.state_ = ClientState.IN_EPISODE
            return reply

    async def astep(self, text: str) -> EnvReply:
        """Async :meth:`step`; must run on the session loop."""
        if self.mcp_tool is not None:
            return await self.acall_tool(self.mcp_tool, {self.action_field: text})
        return await self._astep({self.action_field: text})

    async def astep_action(self, fields: Mapping[str, Any]) -> EnvReply:
        """Async :meth:`step_action`; must run on the session loop."""
        return await self._astep(dict(fields))

    async def acall_tool(self, name: str, arguments: dict[str, Any]) -> EnvReply:
        """Async :meth:`call_tool`; must run on the session loop."""
        return await self._astep({"type": "call_tool", "tool_name": name, "arguments": arguments})

    async def alist_tools(self) -> list[dict[str, Any]]:
        """Async :meth:`list_tools`; must run on the session loop."""
        return (await self._astep(_LIST_TOOLS)).listed_tools()

    async def astate(self) -> dict[str, Any]:
        """Async :meth:`state`; must run on the session loop."""
        if self._sync_ws is not None:
            return await asyncio.to_thread(self.state)
        async with self._guard():
            self._check_connected(self._ws)
            return await self._exchange({"type": "state"}, parse=False)

    async def aclose(self) -> None:
        """Async :meth:`close`."""
        if self._sync_ws is not None:
            await asyncio.to_thread(self.close)
            return
        ws, self._ws = self._ws, None
        self.state_ = ClientState.CLOSED
        if ws is not None:
            with contextlib.suppress(Exception):
                await ws.send(json.dumps({"type": "close"}))
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(), 2.0)

    # -- what both connections share -----------------------------------------------------------

    def _reset_message(self, seed: int | None, task: dict[str, Any]) -> dict[str, Any]:
        if self.state_ is ClientState.CLOSED:
            raise EnvStateError(f"{self.url or 'client'}: reset() after close()")
        data = {**self._task_kwargs(task.get("row_index")), **task}
        if seed is not None:
            data["seed"] = seed
        return {"type": "reset", "data": data}

    def _check_in_episode(self) -> None:
        if self.state_ is ClientState.LOST:
            raise EnvConnectionError(
                f"{self.url}: the session was lost mid-episode; this episode is over, "
                "call reset() to start a new one on a fresh connection"
            )
        if self.state_ is not ClientState.IN_EPISODE:
            raise EnvStateError(
                f"{self.url or 'client'}: step() before reset() (state {self.state_.value})"
            )

    def _check_connected(self, ws: object) -> None:
        if ws is None:
            raise EnvStateError(
                f"{self.url or 'client'}: state() needs an open session; call reset() first"
            )

    def _task_kwargs(self, row_index: Any) -> dict[str, Any]:
        rows = self.eval_tasks if self.eval and self.eval_tasks is not None else self.tasks
        if row_index is None or rows is None:
            return {}
        if not 0 <= int(row_index) < len(rows):
            raise IndexError(f"row_index {row_index} is outside the {len(rows)} tasks")
        return dict(rows[int(row_index)])

    def _connect_options(self, timeout_s: float) -> dict[str, Any]:
        """Keyword arguments of ``connect``, the same for both connection kinds."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        return {
            "open_timeout": timeout_s,
            "compression": None,
            "max_size": _MAX_MESSAGE_BYTES,
            "ping_interval": 20.0,
            "ping_timeout": 20.0,
            "close_timeout": 2.0,
            "additional_headers": headers,
            "proxy": None,
        }

    def _next_url(self) -> str:
        base = self.base_url() if callable(self.base_url) else self.base_url
        self.url = ws_url(base)
        return self.url

    def _retry_delay(self, error: Exception, attempt: int, deadline: float) -> float:
        """Seconds to wait before connecting again; raises when it is no use."""
        if isinstance(error, InvalidStatus) and error.response.status_code in (401, 403):
            raise EnvAuthError(
                f"{self.url}: the server refused the session (HTTP "
                f"{error.response.status_code}); check the token"
            ) from error
        delay = min(0.05 * 2**attempt, 2.0) * random.uniform(0.5, 1.5)
        if time.monotonic() + delay > deadline:
            self.state_ = ClientState.LOST
            raise EnvConnectionError(
                f"{self.url}: cannot connect within {self.connect_timeout_s} s "
                f"({type(error).__name__}: {error})"
            ) from error
        return delay

    def _reply(self, raw: str | bytes, parse: bool) -> Any:
        try:  # a reply holding a bare NaN is not JSON either: refuse it, never read it as nan
            reply = strict_json_loads(raw)
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            raise EnvProtocolError(f"{self.url}: the server's reply is not JSON: {exc}") from None
        if not isinstance(reply, dict):
            raise EnvProtocolError(f"{self.url}: the server's reply is not a JSON object")
        if reply.get("type") == "error":
            raise error_from_wire(reply.get("data") or {}, url=self.url)
        if not parse:
            return reply.get("data") or {}
        if reply.get("type") != "observation":
            raise EnvError(f"{self.url}: expected an observation reply, got {reply.get('type')!r}")
        return EnvReply.from_wire(reply.get("data") or {})

    def _timeout_error(self, message: dict[str, Any]) -> EnvTimeoutError:
        return EnvTimeoutError(
            f"{self.url}: no reply to {message['type']!r} within {self.timeout_s} s; the "
            "session was dropped so its late reply cannot answer a later call"
        )

    def _lost_error(self, message: dict[str, Any], exc: Exception) -> EnvConnectionError:
        return EnvConnectionError(f"{self.url}: connection lost during {message['type']!r} ({exc})")

    # -- the blocking connection -------------------------------------------------------------

    def _step_sync(self, data: dict[str, Any]) -> EnvReply:
        if self._ws is not None:
            return SESSION_LOOP.run(self._astep(data))
        with self._sync_lock:
            self._check_in_episode()
            return self._exchange_sync({"type": "step", "data": data})

    def _connect_sync(self) -> None:
        deadline = time.monotonic() + self.connect_timeout_s
        for attempt in itertools.count():
            url = self._next_url()
            timeout_s = max(deadline - time.monotonic(), 0.05)
            try:
                self._sync_ws = _open_sync(url, self._connect_options(timeout_s))
                self.state_ = ClientState.READY
                return
            except (OSError, TimeoutError, WebSocketException) as exc:
                delay = self._retry_delay(exc, attempt, deadline)
            time.sleep(delay)

    def _exchange_sync(self, message: dict[str, Any], *, parse: bool = True) -> Any:
        ws = self._sync_ws
        assert ws is not None
        frame = _json.dumps(message, json.dumps)
        try:
            with contextlib.suppress(ConnectionClosed):  # a refusal frame may be queued
                ws.send(frame)
            raw = ws.recv(timeout=self.timeout_s)
        except TimeoutError:
            self._drop_sync()
            raise self._timeout_error(message) from None
        except ConnectionClosed as exc:
            self._drop_sync()
            raise self._lost_error(message, exc) from exc
        except BaseException:  # interrupted (Ctrl-C): its reply may still come, unread
            self._drop_sync()
            raise
        try:
            return self._reply(raw, parse)
        except (EnvCapacityError, EnvFactoryError):
            self._drop_sync(state=ClientState.IDLE)
            raise

    def _drop_sync(self, state: ClientState = ClientState.LOST) -> None:
        ws, self._sync_ws = self._sync_ws, None
        self.state_ = state
        if ws is not None:  # the close handshake may wait on a stuck server: not here
            threading.Thread(target=_close_quietly, args=(ws,), daemon=True).start()

    # -- the async connection ----------------------------------------------------------------

    async def _astep(self, data: dict[str, Any]) -> EnvReply:
        if self._sync_ws is not None:
            return await asyncio.to_thread(self._step_sync, data)
        async with self._guard():
            self._check_in_episode()
            return await self._exchange({"type": "step", "data": data})

    def _guard(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def _connect(self) -> None:
        deadline = time.monotonic() + self.connect_timeout_s
        for attempt in itertools.count():
            url = self._next_url()
            timeout_s = max(deadline - time.monotonic(), 0.05)
            try:
                self._ws = await connect(url, **self._connect_options(timeout_s))
                self.state_ = ClientState.READY
                return
            except (OSError, TimeoutError, WebSocketException) as exc:
                delay = self._retry_delay(exc, attempt, deadline)
            await asyncio.sleep(delay)

    async def _exchange(self, message: dict[str, Any], *, parse: bool = True) -> Any:
        ws = self._ws
        assert ws is not None
        frame = _json.dumps(message, json.dumps)
        try:
            with contextlib.suppress(ConnectionClosed):  # a refusal frame may be queued
                await ws.send(frame)
            if self.timeout_s is None:  # no timer to arm: a few % of a step's CPU
                raw = await ws.recv()
            else:
                async with asyncio.timeout(self.timeout_s):
                    raw = await ws.recv()
        except TimeoutError:
            await self._drop()
            raise self._timeout_error(message) from None
        except ConnectionClosed as exc:
            await self._drop()
            raise self._lost_error(message, exc) from exc
        except BaseException:  # cancelled: its reply may still come, unread
            await self._drop()
            raise
        try:
            return self._reply(raw, parse)
        except (EnvCapacityError, EnvFactoryError):
            await self._drop(state=ClientState.IDLE)
            raise

    async def _drop(self, state: ClientState = ClientState.LOST) -> None:
        ws, self._ws = self._ws, None
        self.state_ = state
        if ws is not None:
            asyncio.get_running_loop().create_task(_close_in_background(ws))


async def _close_in_background(ws: ClientConnection) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.close(), 2.0)


def _open_sync(url: str, options: dict[str, Any]) -> SyncClientConnection:
    """A blocking connection, kept open past this call.

    ``connect()`` returns the connection today and a connecter in a later ``websockets``;
    entering either as a context manager gives the connection without a deprecation warning.
    """
    connection: Any = sync_connect(url, **options).__enter__()  # websockets 16 types it looser
    return cast(SyncClientConnection, connection)


def _close_quietly(ws: SyncClientConnection) -> None:
    with contextlib.suppress(Exception):
        ws.close()
