"""The env server's HTTP routes, with the paths and bodies OpenEnv's ``create_app`` serves.

``GET /health``, ``/metadata``, ``/schema``, ``/state``; ``POST /reset``, ``/step`` (each on
a fresh env that is closed afterwards: episodes persist only over ``/ws``, as in OpenEnv) and
``POST /mcp`` (MCP JSON-RPC, plus OpenEnv's ``openenv/session/create`` / ``close``, whose
sessions a ``/ws?session_id=...`` connection attaches to: how OpenEnv's ``MCPToolClient``
works). A WebSocket at ``/mcp`` is one such session for its connection's life, taking bare
JSON-RPC messages (OpenEnv's MCP socket: :meth:`HttpRoutes.serve_mcp_socket`).
``GET /sessions`` (live and allowed sessions) is ours. Every env these routes build
takes a slot of the server's one capacity; when it is full they answer 503.

As OpenEnv's ``register_routes(app, mode=...)``, the routes have two modes: ``"simulation"``
(all of the above) and ``"production"``, which drops the simulation controls ``POST /reset``,
``/step`` and ``GET /state`` (404, as paths never served); ``/ws`` sessions are unchanged.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import time
import uuid
import weakref
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import TypeAdapter, ValidationError

from agile_llmenvs.transport._openenv import (
    JsonRpcErrorCode,
    ResetRequest,
    ResetResponse,
    StepRequest,
    StepResponse,
    deserialize_action,
)
from agile_llmenvs.transport.http import SERVER_ERROR, HttpRequest, HttpResponse
from agile_llmenvs.transport.mcp import mcp_error, mcp_reply, parse_rpc
from agile_llmenvs.transport.protocol import strict_json_loads, validation_errors

if TYPE_CHECKING:
    from agile_llmenvs.transport.sessions import SessionHost

__all__ = [
    "SIMULATION_PATHS",
    "AtCapacity",
    "HttpRoutes",
    "McpSession",
    "ServerMode",
    "server_mode",
]

ServerMode = Literal["simulation", "production"]
#: The routes production mode drops: they reset, step and read an env (OpenEnv's simulation
#: controls); agents in production reach the env through MCP tools only.
SIMULATION_PATHS = frozenset({"/reset", "/step", "/state"})

_NOT_FOUND = HttpResponse(404, {"detail": "Not Found"})
_METHOD_NOT_ALLOWED = HttpResponse(405, {"detail": "Method Not Allowed"})
_SHARED = HttpResponse(
    409,
    {
        "detail": "this server shares one env between sessions (OpenEnvServer(env=...)), so "
        "HTTP /reset, /step and /state, which need an env of their own, are not served; use "
        "a /ws session, or serve with make_env= for a fresh env per call"
    },
)
_GET_PATHS = frozenset({"/health", "/metadata", "/schema", "/state", "/sessions", "/ws"})
_POST_PATHS = frozenset({"/reset", "/step", "/mcp"})


@dataclass
class McpSession:
    """An env session made by ``openenv/session/create``, alive until its close."""

    env: Any
    stack: AsyncExitStack
    last_used: float = field(default_factory=time.monotonic)
    attached: bool = False
    closing: bool = False


class HttpRoutes:
    """Answers the plain HTTP requests of one :class:`SessionHost`."""

    def __init__(self, host: SessionHost, mode: ServerMode = "simulation") -> None:
        self.host = host
        self.mode: ServerMode = mode
        self.sessions: dict[str, McpSession] = {}
        self._metadata: dict[str, Any] | None = None
        # the session id a plain /ws session answers openenv/session/create with
        self._socket_ids: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()

    def serves(self, path: str) -> bool:
        """Whether ``path`` is a route in this mode (production drops :data:`SIMULATION_PATHS`)."""
        return self.mode == "simulation" or path not in SIMULATION_PATHS

    # -- GET ---------------------------------------------------------------------------------

    async def get(self, path: str) -> HttpResponse:
        """The answer to ``GET path`` (any path but ``/ws``)."""
        if not self.serves(path):
            return _NOT_FOUND
        try:
            return await self._get(path)
        except AtCapacity as full:
            return HttpResponse(503, {"detail": str(full)})

    async def _get(self, path: str) -> HttpResponse:
        host = self.host
        if path == "/health":
            exhausted = host.env_calls.threads.exhausted
            if exhausted is not None:  # a supervisor restarts it
                return HttpResponse(503, {"status": "unhealthy", "reason": exhausted})
            return HttpResponse(200, {"status": "healthy"})
        if path == "/sessions":
            return HttpResponse(
                200,
                {
                    "name": host.env_name,
                    "active_sessions": host.active_sessions,
                    "max_sessions": host.max_sessions,
                },
            )
        if path == "/schema":
            types = host.types or await self._with_fresh_env(host.types_of)
            return HttpResponse(200, types.schema())
        if path == "/metadata":
            if self._metadata is None:
                metadata = await self._with_fresh_env(host.metadata)
                self._metadata = metadata.model_dump(mode="json")
            return HttpResponse(200, self._metadata)
        if path == "/state":
            if not host.owns_envs:
                return _SHARED
            return HttpResponse(200, await self._with_fresh_env(self._published_state))
        return _METHOD_NOT_ALLOWED if path in _POST_PATHS else _NOT_FOUND

    # -- POST --------------------------------------------------------------------------------

    async def post(self, request: HttpRequest) -> HttpResponse:
        """The answer to a non-``GET`` request."""
        path = request.path.rstrip("/") or "/"
        if not self.serves(path):
            return _NOT_FOUND
        routes = {"/reset": self._reset, "/step": self._step, "/mcp": self._mcp}
        answer = routes.get(path)
        if answer is None:
            return _METHOD_NOT_ALLOWED if path in _GET_PATHS else _NOT_FOUND
        if request.method != "POST":
            return _METHOD_NOT_ALLOWED
        if not self.host.owns_envs and path != "/mcp":
            return _SHARED
        try:
            return await answer(request)
        except AtCapacity as full:
            return HttpResponse(503, {"detail": str(full)})

    async def _published_state(self, env: Any) -> Any:
        """``env.state`` as ``create_app``'s ``GET /state`` gives it: serialised as the
        published state class (FastAPI's ``response_model``), so fields only a subclass
        declares are dropped. An env whose ``state`` is annotated with its own class keeps
        them: that class is the one published."""
        state = await self.host.state(env)
        published = _adapter(self.host.types_of(env).state)
        checked = published.validate_python(state, from_attributes=True)
        return published.dump_python(checked, mode="json", by_alias=True)

    async def _reset(self, request: HttpRequest) -> HttpResponse:
        reset = _body_model(request, ResetRequest, default={})
        if isinstance(reset, HttpResponse):
            return reset
        kwargs = reset.model_dump(exclude_unset=True)
        try:
            observation = await self._with_fresh_env(lambda env: self.host.reset(env, kwargs))
        except AtCapacity:
            raise
        except Exception:
            return SERVER_ERROR
        return HttpResponse(200, _response(ResetResponse, observation))

    async def _step(self, request: HttpRequest) -> HttpResponse:
        step = _body_model(request, StepRequest)
        if isinstance(step, HttpResponse):
            return step
        host = self.host
        types = host.types or await self._with_fresh_env(host.types_of)
        try:
            action = deserialize_action(step.action, types.action)
        except ValidationError as exc:
            return HttpResponse(422, {"detail": validation_errors(exc)})
        try:
            observation = await self._with_fresh_env(lambda env: host.step(env, action))
        except AtCapacity:
            raise
        except Exception:
            return SERVER_ERROR
        return HttpResponse(200, _response(StepResponse, observation))

    async def _mcp(self, request: HttpRequest) -> HttpResponse:
        try:
            payload = strict_json_loads(request.body)
        except ValueError:
            return HttpResponse(200, mcp_error(JsonRpcErrorCode.PARSE_ERROR, "Parse error"))
        request, error = parse_rpc(payload)
        if error is not None:
            return HttpResponse(200, error)
        return HttpResponse(200, await self.mcp(request))

    # -- MCP sessions ------------------------------------------------------------------------

    async def mcp(self, request: Any, env: Any = None, session_id: str | None = None) -> Any:
        """The reply to one MCP JSON-RPC request: over HTTP (``env`` None), or within the
        ``/ws`` session of ``env``."""
        rid, params = request.id, request.params
        if env is not None and session_id is None:
            session_id = self._socket_id(env)
        if request.method == "openenv/session/create":
            if session_id is not None:  # a socket's session is its own (idempotent)
                return _ok({"session_id": session_id}, rid)
            return await self._create_session(rid)
        if request.method == "openenv/session/close":
            return await self._close_session(params.get("session_id"), session_id, rid)
        wanted = params.get("session_id")
        if env is None and wanted:
            session = self.sessions.get(wanted)
            if session is None:
                return mcp_error(
                    JsonRpcErrorCode.INVALID_PARAMS, f"Unknown session_id: {wanted}", rid
                )
            session.last_used = time.monotonic()
            env = session.env
        elif env is None:  # a one-off env, as for /reset
            try:
                return await self._with_fresh_env(
                    lambda fresh: self._mcp_reply(request, fresh, in_session=False)
                )
            except AtCapacity as full:
                return mcp_error(JsonRpcErrorCode.SERVER_ERROR, str(full), rid)
            except Exception as exc:
                return mcp_error(JsonRpcErrorCode.INTERNAL_ERROR, str(exc), rid)
        return await self._mcp_reply(request, env, in_session=True)

    async def _mcp_reply(self, request: Any, env: Any, *, in_session: bool) -> Any:
        host = self.host
        types = host.types or host.types_of(env)
        return await mcp_reply(
            env,
            types.action,
            request,
            lambda action: host.step(env, action),
            in_session=in_session,
            run=lambda call: host.env_calls.call_bounded(call, "call_tool"),
        )

    def _socket_id(self, env: Any) -> str | None:
        """The id of the plain ``/ws`` session over ``env``, made on first ask (as OpenEnv
        gives every ``/ws`` session one)."""
        try:
            return self._socket_ids.setdefault(env, str(uuid.uuid4()))
        except TypeError:  # an env that takes no weak reference
            return None

    async def serve_mcp_socket(self, ws: Any) -> None:
        """Serve OpenEnv's ``/mcp`` WebSocket on ``ws`` (``recv``/``send`` as in
        ``websockets``): a session of its own (as ``openenv/session/create`` makes) for the
        connection's life, each text message a JSON-RPC request answered by its reply.

        Full capacity or a failing env factory is answered with the JSON-RPC error
        ``create`` gives, and the connection ends.
        """
        created = await self._create_session(None)
        if "error" in created:
            await ws.send(json.dumps(created))
            return
        session_id = created["result"]["session_id"]
        session = self.attach(session_id)
        try:
            while True:
                message = await ws.recv()
                reply: Any
                try:
                    payload = strict_json_loads(message)
                except ValueError as exc:
                    reply = mcp_error(JsonRpcErrorCode.PARSE_ERROR, f"Parse error: {exc}")
                else:
                    request, reply = parse_rpc(payload)
                    if reply is None:
                        reply = await self.mcp(request, session.env, session_id)
                await ws.send(json.dumps(reply))
        finally:
            session.closing = True
            await self.detach(session_id)

    async def _create_session(self, rid: Any) -> Any:
        host = self.host
        await self.reap_idle()
        if not await host.take_slot():
            return mcp_error(
                JsonRpcErrorCode.SERVER_ERROR,
                host.capacity_message(),
                rid,
                data={"active_sessions": host.active_sessions, "max_sessions": host.max_sessions},
            )
        try:
            env = await host.build_env()
        except Exception as exc:
            host.free_slot()
            return mcp_error(JsonRpcErrorCode.SERVER_ERROR, f"env factory failed: {exc}", rid)
        stack = AsyncExitStack()
        try:
            await open_mcp_session(env, stack)
        except Exception as exc:
            await stack.aclose()
            await host.close_env(env)
            host.free_slot()
            return mcp_error(JsonRpcErrorCode.SERVER_ERROR, str(exc), rid)
        session_id = str(uuid.uuid4())
        self.sessions[session_id] = McpSession(env, stack)
        return _ok({"session_id": session_id}, rid)

    async def _close_session(self, wanted: Any, own: str | None, rid: Any) -> Any:
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
        session = self.sessions.get(wanted)
        if session is None:
            return mcp_error(JsonRpcErrorCode.INVALID_PARAMS, f"Unknown session_id: {wanted}", rid)
        if session.attached:
            session.closing = True
            return _ok({"session_id": wanted, "closed": False, "closing": True}, rid)
        await self.end_session(wanted)
        return _ok({"session_id": wanted, "closed": True}, rid)

    def attach(self, session_id: str) -> McpSession:
        """Attach a ``/ws`` connection to an HTTP-made session.

        Raises:
            RuntimeError: no such session, or one that has a ``/ws`` connection already
                (OpenEnv's messages).
        """
        session = self.sessions.get(session_id)
        if session is None:
            raise RuntimeError(f"Unknown session_id: {session_id}")
        if session.attached:
            raise RuntimeError(f"Session {session_id} already has an attached WebSocket")
        session.attached = True
        return session

    async def detach(self, session_id: str) -> None:
        """The ``/ws`` connection of a session left; end the session if a close waits."""
        session = self.sessions.get(session_id)
        if session is None:
            return
        session.attached = False
        session.last_used = time.monotonic()
        if session.closing:
            await self.end_session(session_id)

    async def end_session(self, session_id: str) -> None:
        """Close an HTTP-made session and its env."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        try:
            with contextlib.suppress(Exception):
                await session.stack.aclose()
            await self.host.close_env(session.env)
        finally:
            self.host.free_slot()

    async def close_all(self) -> None:
        """Close every HTTP-made session (the server is stopping)."""
        for session_id in list(self.sessions):
            await self.end_session(session_id)

    async def reap_idle(self) -> None:
        """End sessions no connection has used for ``mcp_session_idle_timeout_s``."""
        idle = self.host.settings.mcp_session_idle_timeout_s
        if idle is None:
            return
        now = time.monotonic()
        for session_id, session in list(self.sessions.items()):
            if not session.attached and now - session.last_used > idle:
                await self.end_session(session_id)

    # -- helpers -----------------------------------------------------------------------------

    async def _with_fresh_env(self, use: Callable[[Any], Any]) -> Any:
        """``use(env)`` (awaited, when it returns an awaitable) on a fresh env, closed after.

        Raises:
            AtCapacity: every slot holds a live env (a shared env takes none).
        """
        host = self.host
        if host.owns_envs and not await host.take_slot():
            raise AtCapacity(
                f"{host.capacity_message()}: every slot holds a live env; retry later, or "
                "serve with a larger max_concurrent_envs"
            )
        try:
            env = await host.build_env()
            try:
                value = use(env)
                return await value if inspect.isawaitable(value) else value
            finally:
                await host.close_env(env)
        finally:
            if host.owns_envs:
                host.free_slot()


def server_mode(mode: str | None = None) -> ServerMode:
    """``mode`` checked (any case; OpenEnv's ``ServerMode`` too); None reads ``OPENENV_MODE``
    (default ``"simulation"``), as OpenEnv's ``create_app`` does.

    Raises:
        ValueError: neither ``"simulation"`` nor ``"production"``.
    """
    if mode is None:
        mode = os.environ.get("OPENENV_MODE", "simulation")
    value = str(getattr(mode, "value", mode)).lower()
    if value == "simulation":
        return "simulation"
    if value == "production":
        return "production"
    raise ValueError(
        f"Invalid mode: {mode!r}; expected 'simulation' (all routes) or 'production' "
        "(no /reset, /step or /state)"
    )


_ADAPTERS: dict[type, TypeAdapter[Any]] = {}


def _adapter(model: type) -> TypeAdapter[Any]:
    """``model``'s (cached) TypeAdapter: FastAPI's ``response_model`` serialisation."""
    adapter = _ADAPTERS.get(model)
    if adapter is None:
        adapter = _ADAPTERS[model] = TypeAdapter(model)
    return adapter


class AtCapacity(Exception):
    """Every slot of the server's capacity holds a live env (answered with HTTP 503)."""


async def open_mcp_session(env: Any, stack: AsyncExitStack) -> None:
    """Hold ``env``'s MCP client session open on ``stack`` (an env without one: nothing)."""
    session = getattr(env, "mcp_session", None)
    if callable(session):
        await stack.enter_async_context(session())


def _ok(result: Any, rid: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "result": result, "id": rid}


def _json_body(request: HttpRequest, default: Any = None) -> Any:
    """The request body as JSON, or the 422 FastAPI answers for a body that is not.

    As in FastAPI, a body is read as JSON only when its content type says JSON; any other
    body (no content type included) is the raw text, which no request model takes.
    """
    body = request.body
    if not body:
        if default is not None:
            return default
        missing = {"type": "missing", "loc": ["body"], "msg": "Field required", "input": None}
        return HttpResponse(422, {"detail": [missing]})
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json" and not kind.endswith("+json"):
        not_an_object = {
            "type": "model_attributes_type",
            "loc": ["body"],
            "msg": "Input should be a valid dictionary or object to extract fields from",
            "input": body.decode("utf-8", "replace"),
        }
        return HttpResponse(422, {"detail": [not_an_object]})
    try:
        return strict_json_loads(body)
    except ValueError as exc:
        invalid = {
            "type": "json_invalid",
            "loc": ["body", getattr(exc, "pos", 0)],
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": getattr(exc, "msg", str(exc))},
        }
        return HttpResponse(422, {"detail": [invalid]})


def _body_model(request: HttpRequest, model: Any, default: Any = None) -> Any:
    """The request body as ``model`` (FastAPI's 422 when it is not JSON or not valid)."""
    payload = _json_body(request, default)
    if isinstance(payload, HttpResponse):
        return payload
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        return _unprocessable(exc, "body")


def _unprocessable(exc: ValidationError, *prefix: str) -> HttpResponse:
    errors = validation_errors(exc, *prefix)
    for error in errors:
        error.pop("url", None)
    return HttpResponse(422, {"detail": errors})


def _response(model: Any, observation: Any) -> dict[str, Any]:
    """``observation`` in OpenEnv's ``ResetResponse`` / ``StepResponse`` body."""
    fields = observation.model_dump(mode="json", exclude={"reward", "done"})
    body: dict[str, Any] = {
        "observation": fields,
        "reward": observation.reward,
        "done": observation.done,
    }
    if observation.metadata:
        body["metadata"] = fields["metadata"]
    return dict(model(**body).model_dump(mode="json"))
