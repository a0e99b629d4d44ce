"""MCP's JSON-RPC ``tools/list`` and ``tools/call`` against one env, as ``create_app`` answers them.

Served at ``POST /mcp`` and in ``{"type": "mcp"}`` messages on ``/ws``. An env with an MCP
client (OpenEnv's ``MCPEnvironment``) is asked through it; an env whose action class is one
of MCP's action types is stepped with ``ListToolsAction`` / ``CallToolAction``; any other env
answers that it does not support MCP. Tool errors come back inside the result, as OpenEnv
sends them; only a malformed request is a JSON-RPC error.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError

from agile_llmenvs.transport._openenv import (
    CallToolAction,
    CallToolObservation,
    JsonRpcErrorCode,
    JsonRpcRequest,
    JsonRpcResponse,
    ListToolsAction,
    ListToolsObservation,
)

__all__ = ["mcp_error", "mcp_reply", "parse_rpc"]

Step = Callable[[Any], Awaitable[Any]]
Run = Callable[[Callable[[], Any]], Awaitable[Any]]


def parse_rpc(payload: Any) -> tuple[Any, dict[str, Any] | None]:
    """``payload`` as a JSON-RPC request, or (None, the error reply)."""
    try:
        return JsonRpcRequest(**payload), None
    except (ValidationError, TypeError) as exc:
        return None, mcp_error(JsonRpcErrorCode.INVALID_REQUEST, f"Invalid request: {exc}")


def mcp_error(code: Any, message: str, request_id: Any = None, data: Any = None) -> dict[str, Any]:
    """A JSON-RPC error reply."""
    return JsonRpcResponse.error_response(
        code, message, data=data, request_id=request_id
    ).model_dump()


def _ok(result: Any, request_id: Any) -> dict[str, Any]:
    return JsonRpcResponse.success(result=result, request_id=request_id).model_dump()


async def mcp_reply(
    env: Any, action_cls: type, request: Any, step: Step, *, in_session: bool, run: Run
) -> dict[str, Any]:
    """The reply to a ``tools/list`` or ``tools/call`` request for ``env``.

    Args:
        env: The env the request is for.
        action_cls: The env's action class (MCP action types mean it is stepped with them).
        request: The parsed JSON-RPC request.
        step: Runs one ``env.step(action)`` where the server runs env calls.
        in_session: Whether ``env`` lives in a session (its MCP client may be connected).
        run: Runs a sync tool function off the event loop, bounded like any env call.
    """
    rid = request.id
    method, params = request.method, request.params
    try:
        if method == "tools/list":
            return await _list_tools(env, action_cls, step, rid, in_session)
        if method == "tools/call":
            name = params.get("name")
            if not name:
                return mcp_error(JsonRpcErrorCode.INVALID_PARAMS, "Missing 'name' in params", rid)
            arguments = params.get("arguments", {})
            return await _call_tool(env, action_cls, step, run, rid, name, arguments, in_session)
        return mcp_error(JsonRpcErrorCode.METHOD_NOT_FOUND, f"Method not found: {method}", rid)
    except Exception as exc:
        return mcp_error(JsonRpcErrorCode.INTERNAL_ERROR, str(exc), rid)


def _steps_mcp(action_cls: type) -> bool:
    return action_cls in (CallToolAction, ListToolsAction)


async def _list_tools(
    env: Any, action_cls: type, step: Step, rid: Any, in_session: bool
) -> dict[str, Any]:
    client, server = getattr(env, "mcp_client", None), getattr(env, "mcp_server", None)
    if client is not None:
        tools = await _client_call(env, client, client.list_tools, in_session)
        return _ok({"tools": [_dump(t) for t in tools]}, rid)
    if server is not None:
        listed = [
            {"name": t.name, "description": t.description or "", "inputSchema": t.parameters or {}}
            for t in _server_tools(server).values()
        ]
        return _ok({"tools": listed}, rid)
    if not _steps_mcp(action_cls):
        return mcp_error(JsonRpcErrorCode.INTERNAL_ERROR, "Environment does not support MCP", rid)
    observation = await step(ListToolsAction())
    if not isinstance(observation, ListToolsObservation):
        return mcp_error(
            JsonRpcErrorCode.INTERNAL_ERROR,
            f"MCP-style tools/list step returned {type(observation).__name__}, expected "
            "ListToolsObservation",
            rid,
        )
    return _ok({"tools": [tool.model_dump() for tool in observation.tools]}, rid)


async def _call_tool(
    env: Any,
    action_cls: type,
    step: Step,
    run: Run,
    rid: Any,
    name: str,
    arguments: dict[str, Any],
    in_session: bool,
) -> dict[str, Any]:
    client, server = getattr(env, "mcp_client", None), getattr(env, "mcp_server", None)
    if client is not None:
        result = await _client_call(
            env, client, lambda: client.call_tool(name=name, arguments=arguments), in_session
        )
        return _ok(_plain(result), rid)
    if server is not None:
        tools = _server_tools(server)
        if name not in tools:
            return mcp_error(JsonRpcErrorCode.INVALID_PARAMS, f"Tool not found: {name}", rid)
        function = tools[name].fn
        if inspect.iscoroutinefunction(function):
            result = await function(**arguments)
        else:  # env code: off the event loop
            result = await run(lambda: function(**arguments))
        if inspect.isawaitable(result):
            result = await result
        return _ok(_plain(result), rid)
    if not _steps_mcp(action_cls):
        return mcp_error(JsonRpcErrorCode.INTERNAL_ERROR, "Environment does not support MCP", rid)
    observation = await step(CallToolAction(tool_name=name, arguments=arguments))
    if not isinstance(observation, CallToolObservation):
        return mcp_error(
            JsonRpcErrorCode.INTERNAL_ERROR,
            f"MCP-style tools/call step returned {type(observation).__name__}, expected "
            "CallToolObservation",
            rid,
        )
    return _ok(_plain(observation), rid)


async def _client_call(
    env: Any, client: Any, operation: Callable[[], Awaitable[Any]], in_session: bool
) -> Any:
    """Run an MCP client call with its transport open (opened here when it is not)."""
    if in_session and client.is_connected():
        return await operation()
    session = getattr(env, "mcp_session", None)
    if callable(session):
        async with session():
            return await operation()
    async with client:
        return await operation()


def _server_tools(server: Any) -> dict[str, Any]:
    from agile_llmenvs.transport._openenv import get_server_tools

    return dict(get_server_tools(server))


def _dump(tool: Any) -> Any:
    return tool.model_dump() if hasattr(tool, "model_dump") else dict(tool)


def _plain(value: Any) -> Any:
    """``value`` as JSON data, the way OpenEnv's server turns tool results into JSON."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if hasattr(value, "model_dump"):
        return value.model_dump()
    if hasattr(value, "__dict__"):
        return {k: _plain(v) for k, v in vars(value).items()}
    return str(value)
