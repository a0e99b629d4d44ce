"""The env server's HTTP routes, with the paths and bodies OpenEnv's ``create_app`` serves.

``GET /health``, ``/metadata``, ``/schema``, ``/state``; ``POST /reset``, ``/step`` (each on
a fresh env that is closed afterwards: episodes persist only over ``/ws``, as in OpenEnv) and
``POST /mcp`` (MCP JSON-RPC, plus OpenEnv's ``openenv/session/create`` / ``close``, whose
sessions a ``/ws?session_id=...`` connection attaches to: how OpenEnv's ``MCPToolClient``
works; they are :class:`~agile_llmenvs.transport.mcp_sessions.McpSessions`). A WebSocket at
``/mcp`` is one such session for its connection's life, taking bare JSON-RPC messages
(OpenEnv's MCP socket: :meth:`HttpRoutes.serve_mcp_socket`).
``GET /sessions`` (live and allowed sessions) is ours. Every env these routes build
takes a slot of the server's one capacity (its
:class:`~agile_llmenvs.transport.env_pool.EnvPool`); when it is full they answer 503.

As OpenEnv's ``register_routes(app, mode=...)``, the routes have two modes: ``"simulation"``
(all of the above) and ``"production"``, which drops the simulation controls ``POST /reset``,
``/step`` and ``GET /state`` (404, as paths never served); ``/ws`` sessions are unchanged.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from agile_llmenvs.transport._openenv import (
    JsonRpcErrorCode,
    ResetRequest,
    ResetResponse,
    StepRequest,
    StepResponse,
    deserialize_action,
)
from agile_llmenvs.transport.env_pool import EnvPool
from agile_llmenvs.transport.http import SERVER_ERROR, HttpRequest, HttpResponse
from agile_llmenvs.transport.http_bodies import body_model
from agile_llmenvs.transport.mcp import mcp_error, mcp_reply, parse_rpc
from agile_llmenvs.transport.mcp_sessions import McpSessions
from agile_llmenvs.transport.protocol import strict_json_loads, validation_errors
from agile_llmenvs.transport.task_api import TaskRoutes

__all__ = [
    "SIMULATION_PATHS",
    "AtCapacity",
    "HttpRoutes",
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


class HttpRoutes:
    """Answers the plain HTTP requests of one server, with the envs of its ``pool``."""

    def __init__(self, pool: EnvPool, mode: ServerMode = "simulation") -> None:
        self.pool = pool
        self.mode: ServerMode = mode
        self.mcp_sessions = McpSessions(pool)
        self.tasks = TaskRoutes(pool, self._with_fresh_env)
        self._metadata: dict[str, Any] | None = None

    def serves(self, path: str) -> bool:
        """Whether ``path`` is a route in this mode (production drops :data:`SIMULATION_PATHS`)."""
        return self.mode == "simulation" or path not in SIMULATION_PATHS

    # -- GET ---------------------------------------------------------------------------------

    async def get(self, path: str) -> HttpResponse:
        """The answer to ``GET path`` (any path but ``/ws``)."""
        if not self.serves(path):
            return _NOT_FOUND
        try:
            if self.tasks.serves("GET", path.rstrip("/")):
                return await self.tasks.answer(HttpRequest("GET", path, {}, {}, b""))
            return await self._get(path)
        except AtCapacity as full:
            return HttpResponse(503, {"detail": str(full)})

    async def _get(self, path: str) -> HttpResponse:
        pool = self.pool
        if path == "/health":
            exhausted = pool.env_calls.threads.exhausted
            if exhausted is not None:  # a supervisor restarts it
                return HttpResponse(503, {"status": "unhealthy", "reason": exhausted})
            return HttpResponse(200, {"status": "healthy"})
        if path == "/sessions":
            return HttpResponse(
                200,
                {
                    "name": pool.env_name,
                    "active_sessions": pool.active_sessions,
                    "max_sessions": pool.max_sessions,
                },
            )
        if path == "/schema":
            types = pool.types or await self._with_fresh_env(pool.types_of)
            return HttpResponse(200, types.schema())
        if path == "/metadata":
            if self._metadata is None:
                metadata = await self._with_fresh_env(pool.metadata)
                self._metadata = metadata.model_dump(mode="json")
            return HttpResponse(200, self._metadata)
        if path == "/state":
            if not pool.owns_envs:
                return _SHARED
            return HttpResponse(200, await self._with_fresh_env(self._published_state))
        return _METHOD_NOT_ALLOWED if path in _POST_PATHS else _NOT_FOUND

    # -- POST --------------------------------------------------------------------------------

    async def post(self, request: HttpRequest) -> HttpResponse:
        """The answer to a non-``GET`` request."""
        path = request.path.rstrip("/") or "/"
        if not self.serves(path):
            return _NOT_FOUND
        if self.tasks.serves(request.method, path):
            try:
                return await self.tasks.answer(request)
            except AtCapacity as full:
                return HttpResponse(503, {"detail": str(full)})
        routes = {"/reset": self._reset, "/step": self._step, "/mcp": self._mcp}
        answer = routes.get(path)
        if answer is None:
            return _METHOD_NOT_ALLOWED if path in _GET_PATHS else _NOT_FOUND
        if request.method != "POST":
            return _METHOD_NOT_ALLOWED
        if not self.pool.owns_envs and path != "/mcp":
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
        state = await self.pool.state(env)
        published = _adapter(self.pool.types_of(env).state)
        checked = published.validate_python(state, from_attributes=True)
        return published.dump_python(checked, mode="json", by_alias=True)

    async def _reset(self, request: HttpRequest) -> HttpResponse:
        reset = body_model(request, ResetRequest, default={})
        if isinstance(reset, HttpResponse):
            return reset
        kwargs = reset.model_dump(exclude_unset=True)
        try:
            observation = await self._with_fresh_env(lambda env: self.pool.reset(env, kwargs))
        except AtCapacity:
            raise
        except Exception:
            return SERVER_ERROR
        return HttpResponse(200, _response(ResetResponse, observation))

    async def _step(self, request: HttpRequest) -> HttpResponse:
        step = body_model(request, StepRequest)
        if isinstance(step, HttpResponse):
            return step
        pool = self.pool
        types = pool.types or await self._with_fresh_env(pool.types_of)
        try:
            action = deserialize_action(step.action, types.action)
        except ValidationError as exc:
            return HttpResponse(422, {"detail": validation_errors(exc)})
        try:
            observation = await self._with_fresh_env(lambda env: pool.step(env, action))
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
        session ``session_id`` (a ``/ws`` or ``/mcp`` connection's) over ``env``."""
        rid, params = request.id, request.params
        sessions = self.mcp_sessions
        if request.method == "openenv/session/create":
            if session_id is not None:  # a connection's session is its own (idempotent)
                return _ok({"session_id": session_id}, rid)
            return await sessions.create(rid)
        if request.method == "openenv/session/close":
            return await sessions.close(params.get("session_id"), session_id, rid)
        wanted = params.get("session_id")
        if env is None and wanted:
            session = self.pool.used(wanted)
            if session is None:
                return mcp_error(
                    JsonRpcErrorCode.INVALID_PARAMS, f"Unknown session_id: {wanted}", rid
                )
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
        pool = self.pool
        types = pool.types or pool.types_of(env)
        return await mcp_reply(
            env,
            types.action,
            request,
            lambda action: pool.step(env, action),
            in_session=in_session,
            run=lambda call: pool.env_calls.call_bounded(call, "call_tool"),
        )

    async def serve_mcp_socket(self, ws: Any) -> None:
        """Serve OpenEnv's ``/mcp`` WebSocket on ``ws``: :meth:`McpSessions.serve_socket`,
        each request answered as :meth:`mcp` answers it within the socket's session."""
        await self.mcp_sessions.serve_socket(ws, self.mcp)

    # -- helpers -----------------------------------------------------------------------------

    async def _with_fresh_env(self, use: Callable[[Any], Any]) -> Any:
        """``use(env)`` (awaited, when it returns an awaitable) on a fresh env, closed after.

        Raises:
            AtCapacity: every slot holds a live env (a shared env takes none).
        """
        pool = self.pool
        if pool.owns_envs and not await pool.take_slot():
            raise AtCapacity(
                f"{pool.capacity_message()}: every slot holds a live env; retry later, or "
                "serve with a larger max_concurrent_envs"
            )
        try:
            env = await pool.build_env()
            try:
                value = use(env)
                return await value if inspect.isawaitable(value) else value
            finally:
                await pool.close_env(env)
        finally:
            if pool.owns_envs:
                pool.free_slot()


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


def _ok(result: Any, rid: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "result": result, "id": rid}


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
