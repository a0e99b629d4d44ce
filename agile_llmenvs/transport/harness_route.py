"""OpenEnv 0.10's production ``/harness`` WebSocket (RFC 005), on both fronts.

An OpenEnv ``HarnessEnvironment`` wraps an external agentic harness (Claude Code, OpenClaw)
behind an adapter. In production mode ``create_app`` lets a client talk to that harness over
``/harness``, and so do ``agile-llmenvs serve`` and the ASGI app, frame for frame:

- on connecting, the session's env is built (in a slot of the server's capacity), its MCP
  session opened and ``reset_async()`` awaited (which starts the harness); then
  ``{"type": "session_started", "data": {"session_id", "harness"}}``;
- each ``{"type": "message", "content": ...}`` frame is one turn: the adapter's
  ``send_message_streaming(content)`` events, each a ``HarnessEvent`` frame, within the
  adapter's ``session_timeout_s``;
- a frame that is not JSON, or not such a message, is answered with a recoverable
  ``protocol_error`` (``INVALID_JSON``, ``VALIDATION_ERROR``) and the session goes on;
- a turn that times out, a harness that is not alive, an adapter that raises (its text is
  never sent: it may hold credentials) or a stream without ``turn_complete`` is answered with
  a terminal ``error`` event, and the session ends (its env closed, the socket closed 1000);
- a full server, a failing factory or a failing reset is answered with an ``error`` frame
  (``CAPACITY_REACHED``, ``FACTORY_ERROR``, ``SESSION_ERROR``), in ``create_app``'s words.

Our own additions, as on ``/ws``: a frame over ``max_message_bytes`` is a recoverable
``MESSAGE_TOO_LARGE`` protocol error, and a session with no message and no turn running for
``session_idle_timeout_s`` is closed (code 1001).

Any other env, or simulation mode, leaves ``/harness`` unserved: the handshake is refused with
403, as ``create_app``'s router refuses a path it has no route for.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from types import ModuleType
from typing import Any

from pydantic import ValidationError
from websockets.exceptions import ConnectionClosed

from agile_llmenvs.transport.env_calls import Discard
from agile_llmenvs.transport.env_pool import EnvPool
from agile_llmenvs.transport.idle import IdleClock, close_when_idle
from agile_llmenvs.transport.mcp_sessions import open_mcp_session
from agile_llmenvs.transport.protocol import ErrorCode
from agile_llmenvs.transport.settings import ServerSettings

__all__ = ["HARNESS_PATH", "HarnessRoute"]

logger = logging.getLogger(__name__)

HARNESS_PATH = "/harness"

_HARNESS_ENV_MODULE = "openenv.core.harness.environment"


class HarnessRoute:
    """The ``/harness`` WebSocket of one server, over the envs of its ``pool``.

    Args:
        pool: The server's :class:`~agile_llmenvs.transport.env_pool.EnvPool`: the
            sessions' envs come from it, each in a slot of its capacity.
    """

    def __init__(self, pool: EnvPool) -> None:
        self.pool = pool
        self._harness_env: bool | None = None  # whether the pool's envs are harness envs

    @property
    def settings(self) -> ServerSettings:
        """The server's :class:`~agile_llmenvs.transport.settings.ServerSettings`."""
        return self.pool.settings

    async def serves(self, mode: str) -> bool:
        """Whether ``/harness`` is served: in production mode, for a ``HarnessEnvironment``.

        The first call in production mode builds one env (in a free slot, closed after) to
        see what the factory makes, as ``create_app`` does at start-up. With no free slot
        and OpenEnv's harness loaded, the answer is yes, and the session says the server
        is full.
        """
        if mode != "production":
            return False
        if self._harness_env is None:
            self._harness_env = await self._probe()
        return self._harness_env is not False and _harness_class() is not None

    async def serve_socket(self, ws: Any) -> None:
        """Serve one ``/harness`` connection on ``ws`` (``recv``/``send``/``close`` as in
        ``websockets``), from its session's start to its end, then close it (1000)."""
        pool = self.pool
        if not await pool.take_slot():
            message = (
                f"Server at capacity: {pool.active_sessions}/{pool.max_sessions} sessions "
                "active. Cannot accept new connections."
            )
            await _send_quietly(ws, _error_frame(message, ErrorCode.CAPACITY_REACHED))
        else:
            try:
                await self._session(ws)
            finally:
                pool.free_slot()
        with contextlib.suppress(ConnectionClosed):
            await ws.close(1000)

    async def _session(self, ws: Any) -> None:
        """Build the env, run the session on it, and close it (the slot is taken)."""
        pool = self.pool
        try:
            env = await pool.build_env()
        except (Exception, Discard) as exc:
            logger.error("harness env factory failed: %s", exc)
            message = f"Environment factory '{_factory_name(pool)}' failed to create instance."
            await _send_quietly(ws, _error_frame(message, ErrorCode.FACTORY_ERROR))
            return
        try:
            async with AsyncExitStack() as stack:
                await open_mcp_session(env, stack)
                await self._run(ws, env)
        except ConnectionClosed:
            pass
        except Exception:
            logger.exception("harness session failed")
            frame = _error_frame("harness session failed", ErrorCode.SESSION_ERROR)
            await _send_quietly(ws, frame)
        finally:
            # the harness process must not outlive its session, even when we are cancelled
            await asyncio.shield(pool.close_env(env))

    async def _run(self, ws: Any, env: Any) -> None:
        """Start the harness, then answer the client's frames until the session ends."""
        settings = self.settings
        loop = asyncio.get_running_loop()
        clock = IdleClock(loop.time())
        clock.busy = True  # starting the harness is work, however long it takes
        idle = settings.session_idle_timeout_s
        watchdog = None if idle is None else asyncio.create_task(close_when_idle(ws, clock, idle))
        try:
            await env.reset_async()
            started = {"session_id": str(uuid.uuid4()), "harness": env.adapter.config.name}
            await ws.send(json.dumps({"type": "session_started", "data": started}))
            clock.busy = False
            clock.last = loop.time()
            while True:
                message = await ws.recv()
                clock.busy = True
                if not await self._answer(ws, env.adapter, message):
                    return
                clock.busy = False
                clock.last = loop.time()
        finally:
            if watchdog is not None:
                watchdog.cancel()

    async def _answer(self, ws: Any, adapter: Any, message: str | bytes) -> bool:
        """Answer one client frame; False once the session ends."""
        events = _openenv_module("events")
        if not isinstance(message, str):  # create_app's receive_text() fails on these
            await ws.send(_error_frame("harness session failed", ErrorCode.SESSION_ERROR))
            return False
        limit = self.settings.max_message_bytes
        if len(message) > limit:
            text = f"Message of {len(message)} bytes exceeds the server's limit of {limit}"
            await ws.send(_protocol_error(events, text, ErrorCode.MESSAGE_TOO_LARGE))
            return True
        try:
            payload = json.loads(message)
        except json.JSONDecodeError as exc:
            await ws.send(_protocol_error(events, f"Invalid JSON: {exc}", ErrorCode.INVALID_JSON))
            return True
        try:
            content = events.HarnessClientMessage(**payload).content
        except (ValidationError, TypeError) as exc:
            text = f"Invalid message: {exc}"
            await ws.send(_protocol_error(events, text, ErrorCode.VALIDATION_ERROR))
            return True
        failure = await _turn(ws, adapter, content)
        if failure is None:
            return True
        error = events.HarnessEvent(
            type=events.HarnessEventType.ERROR, data={"message": failure, "recoverable": False}
        )
        await ws.send(error.model_dump_json())
        return False

    async def _probe(self) -> bool | None:
        """Whether the pool's envs are ``HarnessEnvironment``\\ s (None: no slot to look)."""
        pool = self.pool
        if not pool.owns_envs:  # one shared env: look at it
            return _is_harness(await pool.build_env())
        if not await pool.take_slot():
            return None
        try:
            env = await pool.build_env()
        except (Exception, Discard):
            return None  # the session will say the factory failed
        else:
            await pool.close_env(env)
            return _is_harness(env)
        finally:
            pool.free_slot()


async def _turn(ws: Any, adapter: Any, content: str) -> str | None:
    """Stream one turn's events to ``ws``; None when it completed, else why it failed."""
    not_running = _openenv_module("adapter").HarnessNotRunningError
    timeout = adapter.config.session_timeout_s
    try:
        completed = await asyncio.wait_for(_stream(ws, adapter, content), timeout)
    except TimeoutError:
        return f"harness turn exceeded {timeout} seconds"
    except ConnectionClosed:
        raise
    except not_running:
        return "harness process is not running"
    except Exception:
        # the adapter's text may hold credentials or a subprocess's output: logged only
        logger.exception("harness turn failed")
        return "harness turn failed"
    return None if completed else "harness event stream ended without a TURN_COMPLETE event"


async def _stream(ws: Any, adapter: Any, content: str) -> bool:
    """Send the turn's events; whether the last was ``turn_complete``."""
    event_types = _openenv_module("events").HarnessEventType
    if not await adapter.is_alive():
        raise _openenv_module("adapter").HarnessNotRunningError("harness process is not running")
    completed = False
    events: AsyncIterator[Any] = adapter.send_message_streaming(content)
    async for event in events:
        await ws.send(event.model_dump_json())
        completed = event.type is event_types.TURN_COMPLETE
    return completed


def _harness_class() -> type | None:
    """OpenEnv's ``HarnessEnvironment`` if it is loaded (every harness env loaded it)."""
    module = sys.modules.get(_HARNESS_ENV_MODULE)
    found = getattr(module, "HarnessEnvironment", None)
    return found if isinstance(found, type) else None


def _is_harness(env: Any) -> bool:
    harness = _harness_class()
    return harness is not None and isinstance(env, harness)


def _openenv_module(name: str) -> ModuleType:
    """``openenv.core.harness.<name>`` (loaded already wherever a harness env is served)."""
    return importlib.import_module(f"openenv.core.harness.{name}")


def _factory_name(pool: EnvPool) -> str:
    """The name ``create_app`` gives the env factory in its ``FACTORY_ERROR``."""
    factory = getattr(pool.make_env, "make_env", pool.make_env)  # the user's, not our wrapper
    return str(getattr(factory, "__name__", factory))


def _error_frame(message: str, code: ErrorCode) -> str:
    """OpenEnv's ``WSErrorResponse`` as its ``model_dump_json()`` writes it."""
    frame = {"type": "error", "data": {"message": message, "code": str(code)}}
    return json.dumps(frame, separators=(",", ":"), ensure_ascii=False)


def _protocol_error(events: ModuleType, message: str, code: ErrorCode) -> str:
    error = events.HarnessProtocolError(data={"message": message, "code": str(code)})
    return str(error.model_dump_json())


async def _send_quietly(ws: Any, frame: str) -> None:
    with contextlib.suppress(ConnectionClosed):
        await ws.send(frame)
