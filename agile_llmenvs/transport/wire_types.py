"""The OpenEnv wire types, for a venv without ``openenv`` installed.

``transport._openenv`` hands out OpenEnv's own classes when the ``openenv`` extra is
installed (so ``create_app`` and OpenEnv's clients accept ours as theirs), and these when it
is not: the same fields, defaults and validation on the wire (``/ws`` frames, ``/reset`` and
``/step`` bodies, JSON-RPC for ``/mcp``), so the server, the clients and the wrapper run
unchanged. OpenEnv's extras (its rubrics, web UI, FastMCP tool envs) need the real package.

Why a copy of the wire at all: ``openenv>=0.10`` needs ``fastmcp<4``, hence ``mcp<2``, and a
user's other packages may need ``mcp>=2`` (verifiers 0.4 pins ``mcp==2.0.0``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "Action",
    "CallToolAction",
    "CallToolObservation",
    "Environment",
    "EnvironmentMetadata",
    "JsonRpcError",
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
    "Tool",
    "ToolError",
    "deserialize_action",
]

# Actions and observations: unknown fields are refused, assignments validated, any field type
# (arrays, tensors) allowed. State keeps the extra fields an env adds.
_STRICT = ConfigDict(extra="forbid", validate_assignment=True, arbitrary_types_allowed=True)


class Action(BaseModel):
    """The base of every env's action class."""

    model_config = _STRICT

    metadata: dict[str, Any] = Field(default_factory=dict)


class Observation(BaseModel):
    """The base of every env's observation class."""

    model_config = _STRICT

    done: bool = False
    reward: bool | int | float | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class State(BaseModel):
    """An env's state: its episode id and step count, plus whatever fields it adds."""

    model_config = ConfigDict(extra="allow", validate_assignment=True, arbitrary_types_allowed=True)

    episode_id: str | None = None
    step_count: int = Field(default=0, ge=0)


class EnvironmentMetadata(BaseModel):
    """What ``GET /metadata`` reports of an env."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    name: str
    description: str
    readme_content: str | None = None
    version: str | None = None
    author: str | None = None
    documentation_url: str | None = None


class ResetRequest(BaseModel):
    """The body of ``POST /reset``: a seed, an episode id, and any keyword the env takes."""

    model_config = ConfigDict(extra="allow")

    seed: int | None = Field(default=None, ge=0)
    episode_id: str | None = Field(default=None, max_length=255)


class ResetResponse(BaseModel):
    """The reply to ``POST /reset``."""

    model_config = ConfigDict(extra="forbid")

    observation: dict[str, Any]
    reward: float | None = None
    done: bool = False
    metadata: dict[str, Any] | None = None


class StepRequest(BaseModel):
    """The body of ``POST /step``: the action's fields, plus optional step keywords."""

    model_config = ConfigDict(extra="allow")

    action: dict[str, Any]
    timeout_s: float | None = Field(default=None, gt=0)
    request_id: str | None = Field(default=None, max_length=255)


class StepResponse(BaseModel):
    """The reply to ``POST /step``."""

    model_config = ConfigDict(extra="forbid")

    observation: dict[str, Any]
    reward: float | None = None
    done: bool = False
    metadata: dict[str, Any] | None = None


class JsonRpcErrorCode(int, Enum):
    """JSON-RPC 2.0's error codes (jsonrpc.org/specification, "Error object")."""

    PARSE_ERROR = -32700
    INVALID_REQUEST = -32600
    METHOD_NOT_FOUND = -32601
    INVALID_PARAMS = -32602
    INTERNAL_ERROR = -32603
    SERVER_ERROR = -32000


_DEFAULT_MESSAGES = {
    JsonRpcErrorCode.PARSE_ERROR: "Parse error",
    JsonRpcErrorCode.INVALID_REQUEST: "Invalid Request",
    JsonRpcErrorCode.METHOD_NOT_FOUND: "Method not found",
    JsonRpcErrorCode.INVALID_PARAMS: "Invalid params",
    JsonRpcErrorCode.INTERNAL_ERROR: "Internal error",
    JsonRpcErrorCode.SERVER_ERROR: "Server error",
}


class JsonRpcError(BaseModel):
    """A JSON-RPC error object."""

    model_config = ConfigDict(extra="forbid")

    code: int
    message: str
    data: Any = None

    @classmethod
    def from_code(
        cls, code: JsonRpcErrorCode, message: str | None = None, data: Any = None
    ) -> JsonRpcError:
        """The error for ``code``, with the spec's message unless one is given."""
        return cls(code=code.value, message=message or _DEFAULT_MESSAGES[code], data=data)


class JsonRpcRequest(BaseModel):
    """A JSON-RPC 2.0 request (the body of ``POST /mcp``, the data of a ``/ws`` ``mcp`` frame)."""

    model_config = ConfigDict(extra="forbid")

    jsonrpc: Literal["2.0"]
    method: str
    params: dict[str, Any] = Field(default_factory=dict)
    id: str | int | None = None


class JsonRpcResponse(BaseModel):
    """A JSON-RPC 2.0 response: ``result`` or ``error``, never both, and always ``id``."""

    model_config = ConfigDict(extra="forbid")

    jsonrpc: Literal["2.0"] = "2.0"
    result: Any = None
    error: JsonRpcError | None = None
    id: str | int | None = None

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        """The wire form: ``jsonrpc``, ``id`` and one of ``error`` / ``result``."""
        body: dict[str, Any] = {"jsonrpc": self.jsonrpc, "id": self.id}
        if self.error is not None:
            body["error"] = self.error.model_dump()
        else:
            body["result"] = self.result
        return body

    @classmethod
    def success(cls, result: Any, request_id: str | int | None = None) -> JsonRpcResponse:
        """A reply carrying ``result``."""
        return cls(result=result, id=request_id)

    @classmethod
    def error_response(
        cls,
        code: JsonRpcErrorCode,
        message: str | None = None,
        data: Any = None,
        request_id: str | int | None = None,
    ) -> JsonRpcResponse:
        """A reply carrying the error for ``code``."""
        return cls(error=JsonRpcError.from_code(code, message, data), id=request_id)


class Tool(BaseModel):
    """One tool an MCP env offers: its name, description and JSON schema of its arguments."""

    model_config = ConfigDict(extra="forbid")

    name: str
    description: str
    input_schema: dict[str, Any]


class ToolError(BaseModel):
    """Why a tool call failed outside the tool itself (unknown tool, bad arguments, timeout)."""

    model_config = ConfigDict(extra="forbid")

    error_type: Literal[
        "execution_error", "invalid_args", "transport_error", "tool_not_found", "timeout"
    ]
    message: str


class ListToolsAction(Action):
    """Ask an MCP env for its tools."""

    type: Literal["list_tools"] = "list_tools"


class CallToolAction(Action):
    """Call one of an MCP env's tools."""

    type: Literal["call_tool"] = "call_tool"
    tool_name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ListToolsObservation(Observation):
    """An MCP env's tools."""

    tools: list[Tool]


class CallToolObservation(Observation):
    """A tool's result, or the error that kept it from running."""

    tool_name: str
    result: Any = None
    error: ToolError | None = None


class Environment(ABC):
    """The env ABC OpenEnv's servers drive: ``reset``, ``step`` and ``state``.

    ``reset_async`` / ``step_async`` default to the blocking methods; an env with real async
    work overrides them. ``SUPPORTS_CONCURRENT_SESSIONS`` says whether one server may build
    more than one instance at a time.
    """

    SUPPORTS_CONCURRENT_SESSIONS: bool = False
    REQUIRES_SINGLE_THREAD_EXECUTOR: bool = False

    def __init__(self, transform: Any = None, rubric: Any = None) -> None:
        self.transform = transform
        self.rubric = rubric

    @abstractmethod
    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Any:
        """Start an episode and return its first observation."""

    async def reset_async(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> Any:
        """``reset`` for an async caller; override for real async work."""
        return self.reset(seed=seed, episode_id=episode_id, **kwargs)

    @abstractmethod
    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """Apply ``action`` and return the next observation."""

    async def step_async(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """``step`` for an async caller; override for real async work."""
        return self.step(action, timeout_s=timeout_s, **kwargs)

    @property
    @abstractmethod
    def state(self) -> Any:
        """The env's current :class:`State`."""

    def get_metadata(self) -> EnvironmentMetadata:
        """The env's name and description; override to say more."""
        name = type(self).__name__
        return EnvironmentMetadata(name=name, description=f"{name} environment", version="1.0.0")

    def _apply_transform(self, observation: Any) -> Any:
        return observation if self.transform is None else self.transform(observation)

    def close(self) -> None:  # noqa: B027 - a no-op an env overrides when it holds resources
        """Release what the env holds."""


_MCP_ACTIONS: dict[str, type[Action]] = {"list_tools": ListToolsAction, "call_tool": CallToolAction}


def deserialize_action(action_data: dict[str, Any], action_cls: type[Action]) -> Action:
    """``action_data`` validated as ``action_cls``.

    An MCP payload (``type`` ``list_tools`` or ``call_tool``) becomes the MCP action when the
    env's action class is the plain :class:`Action` or an MCP action itself; an env with its
    own action class validates every payload itself.
    """
    mcp_cls = _MCP_ACTIONS.get(action_data.get("type", ""))
    if mcp_cls is not None and (action_cls is Action or action_cls in _MCP_ACTIONS.values()):
        return mcp_cls.model_validate(action_data)
    return action_cls.model_validate(action_data)
