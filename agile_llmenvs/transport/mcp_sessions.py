"""MCP sessions: envs held between JSON-RPC requests, as OpenEnv's ``MCPToolClient`` uses them.

``openenv/session/create`` (over ``POST /mcp``) makes one, ``openenv/session/close`` ends it;
a ``/ws?session_id=...`` connection attaches to one, and a WebSocket at ``/mcp`` is one for
its connection's life (:meth:`McpSessions.serve_socket`). Each is an env the server's
:class:`~agile_llmenvs.transport.env_pool.EnvPool` holds between requests, in a slot of its
capacity until it ends; one no connection holds and no request has used for
``mcp_session_idle_timeout_s`` is reaped.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

from agile_llmenvs.transport._openenv import JsonRpcErrorCode
from agile_llmenvs.transport.env_pool import EnvPool
from agile_llmenvs.transport.idle import IdleClock, close_when_idle
from agile_llmenvs.transport.mcp import mcp_error, parse_rpc
from agile_llmenvs.transport.protocol import strict_json_loads

__all__ = ["McpSessions", "open_mcp_session"]

#: Answers one parsed JSON-RPC request within a session: ``(request, env, session_id)``.
McpAnswer = Callable[[Any, Any, str], Awaitable[Any]]


class McpSessions:
    """The MCP session requests of one server, over the envs its ``pool`` holds."""

    def __init__(self, pool: EnvPool) -> None:
        self.pool = pool

    async def create(self, rid: Any) -> Any:
        """``openenv/session/create``'s reply: a new session's id, or the JSON-RPC error
        of a full server or a failing env factory."""
        pool = self.pool
        await pool.reap_idle()
        if not await pool.take_slot():
            return mcp_error(
                JsonRpcErrorCode.SERVER_ERROR,
                pool.capacity_message(),
                rid,
                data={"active_sessions": pool.active_sessions, "max_sessions": pool.max_sessions},
            )
        try:
            env = await pool.build_env()
        except Exception as exc:
            pool.free_slot()
            return mcp_error(JsonRpcErrorCode.SERVER_ERROR, f"env factory failed: {exc}", rid)
        stack = AsyncExitStack()
        try:
            await open_mcp_session(env, stack)
        except Exception as exc:
            await stack.aclose()
            await pool.close_env(env)
            pool.free_slot()
            return mcp_error(JsonRpcErrorCode.SERVER_ERROR, str(exc), rid)
        return _ok({"session_id": pool.hold(env, stack)}, rid)

    async def close(self, wanted: Any, own: str | None, rid: Any) -> Any:
        """``openenv/session/close``'s reply for session ``wanted``, asked within the session
        ``own`` (None: over HTTP). A session a connection holds ends when it leaves."""
        if not wanted:
            return mcp_error(
                JsonRpcErrorCode.INVALID_PARAMS, "Invalid params - 'session_id' is required", rid
            )
        if own is not None and wanted == own:
            return mcp_error(
                JsonRpcErrorCode.INVALID_REQUEST,
                "Cannot close active WebSocket-managed session via MCP method",
                rid,
            )
        session = self.pool.held.get(wanted)
        if session is None:
            return mcp_error(JsonRpcErrorCode.INVALID_PARAMS, f"Unknown session_id: {wanted}", rid)
        if session.attached:
            session.closing = True
            return _ok({"session_id": wanted, "closed": False, "closing": True}, rid)
        await self.pool.end(wanted)
        return _ok({"session_id": wanted, "closed": True}, rid)

    async def serve_socket(self, ws: Any, answer: McpAnswer) -> None:
        """Serve OpenEnv's ``/mcp`` WebSocket on ``ws`` (``recv``/``send``/``close`` as in
        ``websockets``): a session of its own (as ``openenv/session/create`` makes) for the
        connection's life, each text message a JSON-RPC request answered by ``answer``.

        Full capacity (told on connecting) or a failing env factory is answered with the
        JSON-RPC error ``create`` gives, and the connection ends. A message over
        ``max_message_bytes`` is answered ``INVALID_REQUEST`` without being parsed, and the
        session goes on. The
        session (and its env, and its slot) is made at the first message: a connection that
        sends none within ``first_message_timeout_s`` is closed (code 1008) having held
        nothing, as ``/ws`` closes one. A connection idle (no message, no call running) for
        ``session_idle_timeout_s`` is closed (code 1001), its slot freed.
        """
        settings, pool = self.pool.settings, self.pool
        if pool.full():  # told at once, as before any message, when no slot is left
            await pool.reap_idle()
            if pool.full():
                await ws.send(json.dumps(await self.create(None)))
                return
        try:
            message = await asyncio.wait_for(ws.recv(), settings.first_message_timeout_s)
        except TimeoutError:
            await ws.close(1008, "no message within first_message_timeout_s")
            return
        created = await self.create(None)
        if "error" in created:
            await ws.send(json.dumps(created))
            return
        session_id = created["result"]["session_id"]
        session = self.pool.attach(session_id)
        idle = settings.session_idle_timeout_s
        limit = settings.max_message_bytes
        loop = asyncio.get_running_loop()
        clock = IdleClock(loop.time())
        watchdog = None if idle is None else asyncio.create_task(close_when_idle(ws, clock, idle))
        try:
            while True:
                if message is None:
                    message = await ws.recv()
                clock.busy = True
                reply: Any
                if len(message) > limit:  # answered unread, as /ws answers MESSAGE_TOO_LARGE
                    reply = mcp_error(
                        JsonRpcErrorCode.INVALID_REQUEST,
                        f"Message of {len(message)} bytes exceeds the server's limit of {limit}",
                    )
                else:
                    reply = await self._answer_text(message, answer, session.env, session_id)
                await ws.send(json.dumps(reply))
                message = None
                clock.busy = False
                clock.last = loop.time()
        finally:
            if watchdog is not None:
                watchdog.cancel()
            session.closing = True
            await self.pool.detach(session_id)

    @staticmethod
    async def _answer_text(message: Any, answer: McpAnswer, env: Any, session_id: str) -> Any:
        try:
            payload = strict_json_loads(message)
        except ValueError as exc:
            return mcp_error(JsonRpcErrorCode.PARSE_ERROR, f"Parse error: {exc}")
        request, reply = parse_rpc(payload)
        return reply if reply is not None else await answer(request, env, session_id)


async def open_mcp_session(env: Any, stack: AsyncExitStack) -> None:
    """Hold ``env``'s MCP client session open on ``stack`` (an env without one: nothing)."""
    session = getattr(env, "mcp_session", None)
    if callable(session):
        await stack.enter_async_context(session())


def _ok(result: Any, rid: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "result": result, "id": rid}
