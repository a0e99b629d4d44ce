"""Our copy of the OpenEnv wire (``transport.wire_types``, used where ``openenv`` is not
installed) against OpenEnv's own classes: the same fields, defaults, strictness, error codes and
action parsing, so a server or client on either speaks the same frames."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from agile_llmenvs.transport import _openenv, wire_types

needs_openenv = pytest.mark.skipif(
    importlib.util.find_spec("openenv") is None, reason="compares against the openenv package"
)

MODELS = [
    "Action",
    "Observation",
    "State",
    "EnvironmentMetadata",
    "ResetRequest",
    "ResetResponse",
    "StepRequest",
    "StepResponse",
    "JsonRpcError",
    "JsonRpcRequest",
    "JsonRpcResponse",
    "Tool",
    "ToolError",
    "ListToolsAction",
    "CallToolAction",
    "ListToolsObservation",
    "CallToolObservation",
]


def _theirs(name: str) -> type:
    module = "types" if hasattr(_openenv._types, name) else "mcp_types"
    return getattr(_openenv._load(module), name)


def _shape(model: type[BaseModel]) -> dict[str, object]:
    fields = {
        name: (
            field.is_required(),
            None if field.default is PydanticUndefined else field.default,
            field.default_factory() if field.default_factory else None,
            [repr(m) for m in field.metadata],
        )
        for name, field in model.model_fields.items()
    }
    config = {key: model.model_config.get(key) for key in ("extra", "validate_assignment")}
    return {"fields": fields, "config": config}


@needs_openenv
@pytest.mark.parametrize("name", MODELS)
def test_every_wire_model_has_openenvs_fields_defaults_and_strictness(name: str) -> None:
    ours, theirs = getattr(wire_types, name), _theirs(name)
    assert _shape(ours) == _shape(theirs)


@needs_openenv
def test_error_codes_and_rpc_replies_match() -> None:
    theirs = _openenv._load("mcp_types")
    assert {c.name: c.value for c in wire_types.JsonRpcErrorCode} == {
        c.name: c.value for c in theirs.JsonRpcErrorCode
    }
    for code in wire_types.JsonRpcErrorCode:
        ours = wire_types.JsonRpcResponse.error_response(code, data={"x": 1}, request_id=7)
        their = theirs.JsonRpcResponse.error_response(
            theirs.JsonRpcErrorCode(code.value), data={"x": 1}, request_id=7
        )
        assert ours.model_dump() == their.model_dump()
    ok = wire_types.JsonRpcResponse.success(result=None, request_id="a").model_dump()
    assert ok == {"jsonrpc": "2.0", "id": "a", "result": None}
    assert ok == theirs.JsonRpcResponse.success(result=None, request_id="a").model_dump()


class Move(wire_types.Action):
    cell: int


@needs_openenv
@pytest.mark.parametrize(
    "payload",
    [
        {"type": "list_tools"},
        {"type": "call_tool", "tool_name": "add", "arguments": {"a": 1}},
        {"metadata": {"k": 1}},
        {"bogus": 1},
    ],
)
def test_deserialize_action_on_the_plain_action_class_matches(payload: dict) -> None:
    theirs = _openenv._load("serialization").deserialize_action
    their_action = _openenv._load("types").Action

    def parse(function, action_cls):
        try:
            action = function(payload, action_cls)
        except ValidationError as exc:
            return ("invalid", [e["type"] for e in exc.errors()])
        return (type(action).__name__, action.model_dump())

    assert parse(wire_types.deserialize_action, wire_types.Action) == parse(theirs, their_action)


def test_an_env_with_its_own_action_class_validates_an_mcp_payload_itself() -> None:
    with pytest.raises(ValidationError) as info:
        wire_types.deserialize_action({"type": "list_tools"}, Move)
    # Move refuses the unknown "type" and wants its "cell": the MCP shortcut is not taken
    assert sorted(e["type"] for e in info.value.errors()) == ["extra_forbidden", "missing"]
    move = wire_types.deserialize_action({"cell": 4}, Move)
    assert (type(move), move.cell, move.metadata) == (Move, 4, {})


class Counter(wire_types.Environment):
    def __init__(self) -> None:
        super().__init__()
        self._state = wire_types.State(episode_id="e", step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = wire_types.State(episode_id=episode_id, step_count=0)
        return wire_types.Observation(metadata={"seed": seed, **kwargs})

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        return wire_types.Observation(done=True, reward=1.0)

    @property
    def state(self) -> wire_types.State:
        return self._state


def test_the_env_abc_defaults_async_calls_metadata_and_close() -> None:
    env = Counter()
    first = asyncio.run(env.reset_async(seed=3, episode_id="ep", level=2))
    assert first.metadata == {"seed": 3, "level": 2}
    last = asyncio.run(env.step_async(wire_types.Action()))
    assert (last.done, last.reward, env.state.step_count, env.state.episode_id) == (
        True,
        1.0,
        1,
        "ep",
    )
    assert env.get_metadata().model_dump() == {
        "name": "Counter",
        "description": "Counter environment",
        "readme_content": None,
        "version": "1.0.0",
        "author": None,
        "documentation_url": None,
    }
    assert env.close() is None
    with pytest.raises(ValidationError):
        env.state.step_count = -1  # validate_assignment, ge=0


def test_without_openenv_the_wire_types_are_ours() -> None:
    """Where ``openenv`` is absent (the verifiers 0.4 venv in CI), every name comes from
    ``wire_types`` and a FastMCP tool env says which extra to install."""
    if _openenv.OPENENV_INSTALLED:
        assert _openenv.Action is not wire_types.Action
        assert _openenv.Action.__module__ == "openenv.core.env_server.types"
        return
    for name in ("Action", "Observation", "State", "Environment", "deserialize_action"):
        assert getattr(_openenv, name) is getattr(wire_types, name)
    with pytest.raises(ImportError, match=r"pip install 'agile-llmenvs\[openenv\]'"):
        _openenv.get_server_tools(object())
