"""OpenEnv's typed env ABC and wire types, imported without its eager web UI.

``import openenv.core`` runs package ``__init__`` files that import gradio: about 4-6 s per
process on these machines, paid again by every env host, worker and CLI call. The modules we
need (``interfaces``, ``types``, ``mcp_types``, ``serialization``) import nothing heavy, so we
load them under stand-in parent packages and then remove the stand-ins. A later
``import openenv.core`` runs the real ``__init__`` files, which find these very modules in
``sys.modules``: the classes stay identical objects, so ``create_app`` and OpenEnv's clients
accept ours.

Without the ``openenv`` extra the same names come from :mod:`agile_llmenvs.transport.wire_types`,
our own copy of the wire: ``OPENENV_INSTALLED`` says which. Only FastMCP tool envs
(:func:`get_server_tools`) need the real package.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

__all__ = [
    "OPENENV_INSTALLED",
    "Action",
    "CallToolAction",
    "CallToolObservation",
    "Environment",
    "EnvironmentMetadata",
    "JsonRpcErrorCode",
    "JsonRpcRequest",
    "JsonRpcResponse",
    "ListToolsAction",
    "ListToolsObservation",
    "Observation",
    "ResetRequest",
    "ResetResponse",
    "State",
    "StepRequest",
    "StepResponse",
    "deserialize_action",
    "get_server_tools",
]

_PARENTS = ("openenv.core", "openenv.core.env_server")


def _load(name: str) -> Any:
    if all(parent in sys.modules for parent in _PARENTS):
        return importlib.import_module(f"openenv.core.env_server.{name}")
    import openenv

    root = Path(openenv.__file__).parent
    stand_ins: list[str] = []
    for parent in _PARENTS:
        if parent not in sys.modules:
            module = types.ModuleType(parent)
            module.__path__ = [str(root.joinpath(*parent.split(".")[1:]))]
            sys.modules[parent] = module
            stand_ins.append(parent)
    try:
        return importlib.import_module(f"openenv.core.env_server.{name}")
    finally:
        for parent in stand_ins:
            stand_in = sys.modules.pop(parent)
            owner = sys.modules.get(parent.rpartition(".")[0])
            child = parent.rpartition(".")[2]
            if owner is not None and getattr(owner, child, None) is stand_in:
                delattr(owner, child)


OPENENV_INSTALLED = importlib.util.find_spec("openenv") is not None

if OPENENV_INSTALLED:
    _interfaces = _load("interfaces")
    _types = _load("types")
    _mcp = _load("mcp_types")
    _serialization = _load("serialization")
else:
    from agile_llmenvs.transport import wire_types

    _interfaces = _types = _mcp = _serialization = wire_types

Environment: Any = _interfaces.Environment
Action: Any = _types.Action
Observation: Any = _types.Observation
State: Any = _types.State
EnvironmentMetadata: Any = _types.EnvironmentMetadata
CallToolAction: Any = _mcp.CallToolAction
ListToolsAction: Any = _mcp.ListToolsAction
CallToolObservation: Any = _mcp.CallToolObservation
ListToolsObservation: Any = _mcp.ListToolsObservation
JsonRpcErrorCode: Any = _mcp.JsonRpcErrorCode
JsonRpcRequest: Any = _mcp.JsonRpcRequest
JsonRpcResponse: Any = _mcp.JsonRpcResponse
ResetRequest: Any = _types.ResetRequest
ResetResponse: Any = _types.ResetResponse
StepRequest: Any = _types.StepRequest
StepResponse: Any = _types.StepResponse
deserialize_action: Any = _serialization.deserialize_action


def get_server_tools(server: Any) -> Any:
    """OpenEnv's tools of a FastMCP server (loads ``mcp_environment``, and fastmcp, on use)."""
    if not OPENENV_INSTALLED:
        raise ImportError(
            "an MCP env built on a FastMCP server needs OpenEnv: "
            "pip install 'agile-llmenvs[openenv]'"
        )
    return _load("mcp_environment").get_server_tools(server)
