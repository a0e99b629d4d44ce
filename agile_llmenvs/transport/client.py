"""The client interface a rollout drives, and its in-process implementation."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pydantic import ValidationError

from agile_llmenvs.errors import AgileLLMEnvsError, EnvProtocolError, EnvStateError
from agile_llmenvs.transport._openenv import CallToolAction, Environment, ListToolsAction
from agile_llmenvs.transport.env_types import infer_env_types
from agile_llmenvs.transport.protocol import (
    ErrorCode,
    WireError,
    code_for_exception,
    error_from_wire,
    exception_location,
    holds_no_float,
    observation_frame,
    refuse_non_finite,
    validation_errors,
)
from agile_llmenvs.transport.types import EnvReply, TextAction, TextObservation
from agile_llmenvs.transport.wrapper import OpenEnvWrapper

if TYPE_CHECKING:
    from agile_llmenvs.core.contract import TextEnv

__all__ = ["EnvClientProtocol", "InProcessEnvClient", "SupportsListTools", "SupportsToolCalls"]


@runtime_checkable
class EnvClientProtocol(Protocol):
    """One env instance as a rollout sees it, wherever the env lives."""

    def reset(self, *, seed: int | None = None, **task: Any) -> EnvReply:
        """Start an episode; ``task`` holds reset kwargs such as ``row_index``."""
        ...

    def step(self, text: str) -> EnvReply:
        """Send the policy's text; returns the env's reply."""
        ...

    def state(self) -> dict[str, Any]:
        """The env's OpenEnv state (``dataset_size``, ``tools``, ...)."""
        ...

    def close(self) -> None:
        """Release the env."""
        ...


@runtime_checkable
class SupportsToolCalls(Protocol):
    """A client that can call an env's MCP tools."""

    def call_tool(self, name: str, arguments: dict[str, Any]) -> EnvReply:
        """Call tool ``name`` with ``arguments``."""
        ...


@runtime_checkable
class SupportsListTools(Protocol):
    """A client that can list an env's MCP tools."""

    def list_tools(self) -> list[dict[str, Any]]:
        """The env's tools, each with ``name``, ``description`` and ``input_schema``."""
        ...


class InProcessEnvClient:
    """Drives an environment object living in this process: no server, no sockets.

    A plain text env is wrapped in :class:`OpenEnvWrapper` and every reply goes through the
    same serialisation as on the wire, so an env behaves exactly as it would when hosted:
    the same replies, and the same error types (an env exception is an
    :class:`~agile_llmenvs.errors.EnvExecutionError`, a bad action an
    :class:`~agile_llmenvs.errors.EnvProtocolError`). A reply holding a non-finite number
    (a NaN reward, say), which the wire cannot carry, is an ``EnvExecutionError`` naming the
    env, the step and the value, as a server answers it.
    An OpenEnv ``Environment`` is used as it is.

    Args:
        env: The env to drive: a text env or an OpenEnv ``Environment``.
        action_field: Field of the env's action class the model's text goes into.
        action_cls: The env's action class, which every step is validated against, as
            :class:`~agile_llmenvs.transport.OpenEnvServer` takes it (default: the env's
            ``step`` annotation; :class:`TextAction` for a text env).
    """

    def __init__(
        self,
        env: TextEnv | Environment,
        *,
        action_field: str = "message",
        action_cls: type | None = None,
    ) -> None:
        if isinstance(env, Environment):
            self.env = env
        else:
            self.env = OpenEnvWrapper(env, owns_inner=True)
        self.action_cls: type = infer_env_types(self.env, action_cls=action_cls).action
        self.action_field = action_field
        self._closed = False
        # our own wrapper, as it is, takes the text without the action and observation models
        self._direct: OpenEnvWrapper | None = None
        if (
            isinstance(self.env, OpenEnvWrapper)
            and self.env.takes_text_directly()
            and self.action_cls is TextAction
            and action_field == "message"
        ):
            self._direct = self.env
        self._direct_reset = self._direct is not None and (
            type(self._direct).reset is OpenEnvWrapper.reset
        )
        self._steps = 0  # since the last reset: named by a refused reply

    def reset(self, *, seed: int | None = None, **task: Any) -> EnvReply:
        """Reset the env with ``seed`` and the task's kwargs."""
        self._check_open()
        self._steps = 0
        if self._direct_reset:
            assert self._direct is not None
            return self._parsed(
                _text_reply, self._call(self._direct.reset_fields, seed=seed, **task)
            )
        return self._parsed(_reply, self._call(self.env.reset, seed=seed, **task))

    def step(self, text: str) -> EnvReply:
        """Send ``text`` in the action's ``action_field``."""
        self._check_open()
        if self._direct is not None and type(text) is str:
            self._steps += 1
            return self._parsed(_text_reply, self._call(self._direct.step_fields, text))
        return self.step_action({self.action_field: text})

    def step_action(self, fields: Mapping[str, Any]) -> EnvReply:
        """Send an action given by its fields (what an ``action_parser`` made of the text).

        Raises:
            EnvProtocolError: the fields do not validate against ``action_cls``; its
                ``field_errors`` name each invalid field, as a server's refusal does.
        """
        self._check_open()
        self._steps += 1
        action = self._call(self._action, fields)
        return self._parsed(_reply, self._call(self.env.step, action))

    def call_tool(self, name: str, arguments: dict[str, Any]) -> EnvReply:
        """Call an MCP tool of an OpenEnv MCP environment.

        Raises:
            EnvProtocolError: the env takes text actions, not tool calls.
        """
        self._check_open()
        if isinstance(self.env, OpenEnvWrapper):
            raise EnvProtocolError(
                f"in-process env {self.env.env_name!r} takes text actions, not tool calls"
            )
        self._steps += 1
        action = self._call(CallToolAction, tool_name=name, arguments=arguments)
        return self._parsed(_reply, self._call(self.env.step, action))

    def list_tools(self) -> list[dict[str, Any]]:
        """The tools of an OpenEnv MCP environment (its ``ListToolsAction``), each with
        ``name``, ``description`` and ``input_schema``.

        Raises:
            EnvProtocolError: the env is not an MCP environment.
        """
        self._check_open()
        if not _is_mcp_env(self.env):
            raise EnvProtocolError(
                f"in-process env {type(self.env).__name__!r} is not an MCP environment: it "
                "has no tools to list"
            )
        return _reply(self._call(self.env.step, ListToolsAction())).listed_tools()

    def state(self) -> dict[str, Any]:
        """The env's OpenEnv state as plain JSON data."""
        self._check_open()
        return dict(json.loads(self.env.state.model_dump_json()))

    def close(self) -> None:
        """Close the env; idempotent."""
        if not self._closed:
            self._closed = True
            self.env.close()

    def __enter__(self) -> InProcessEnvClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise EnvStateError("this InProcessEnvClient is closed")

    def _parsed(self, parse: Callable[[Any], EnvReply], observation: Any) -> EnvReply:
        """``parse(observation)``; a non-finite number in it is the error a server sends."""
        try:
            return parse(observation)
        except WireError as exc:
            name = getattr(self.env, "env_name", type(self.env).__name__)
            call = f"step {self._steps}" if self._steps else "reset"
            message = {"code": exc.code, "message": str(exc)}
            raise error_from_wire(message, url=f"in-process env {name!r}, {call}") from None

    def _action(self, fields: Mapping[str, Any]) -> Any:
        """The action with these fields; invalid ones are refused as a server refuses them
        (OpenEnv's ``Invalid message`` with the field errors)."""
        try:
            return self.action_cls(**fields)
        except ValidationError as exc:
            message = {
                "code": ErrorCode.VALIDATION_ERROR,
                "message": "Invalid message",
                "errors": validation_errors(exc),
            }
            raise error_from_wire(message, url="in-process env") from None

    @staticmethod
    def _call(method: Any, *args: Any, **kwargs: Any) -> Any:
        """Call into the env, raising what a remote client would for the same failure."""
        try:
            return method(*args, **kwargs)
        except AgileLLMEnvsError:
            raise
        except Exception as exc:
            message = {
                "code": code_for_exception(exc),
                "message": f"{type(exc).__name__}: {exc}",
                "error_type": type(exc).__name__,
                "location": exception_location(exc),
            }
            raise error_from_wire(message, url="in-process env") from exc


def _is_mcp_env(env: object) -> bool:
    """Whether ``env`` is OpenEnv's ``MCPEnvironment``, without importing its module (and
    fastmcp) for every env: an instance exists only once that module is loaded."""
    module = sys.modules.get("openenv.core.env_server.mcp_environment")
    return module is not None and isinstance(env, module.MCPEnvironment)


def _text_reply(fields: dict[str, Any]) -> EnvReply:
    """The reply to an observation with these :class:`TextObservation` field values (reward,
    done and the rest at their defaults when absent, as after a reset); the reply holds
    ``fields["metadata"]`` itself (a copy of the env's info the caller made)."""
    reward = fields.get("reward")
    metadata = fields["metadata"]
    if (metadata and not holds_no_float(metadata)) or (
        reward is not None and not math.isfinite(reward)
    ):
        # the rest are JSON values already, but for a non-finite number in the env's info:
        # searched in the order the wire frame holds them, so both name the same field
        refuse_non_finite({"observation": {"metadata": metadata}, "reward": reward})
    observation = {
        "prompt": fields["prompt"],
        "truncated": fields.get("truncated", False),
        "question": fields.get("question"),
        "answer": fields.get("answer"),
    }
    if fields.get("images"):  # as on the wire: present only when there are images
        observation["images"] = fields["images"]
    return EnvReply(
        observation,
        None if reward is None else float(reward),
        bool(fields.get("done", False)),
        metadata,
    )


def _reply(observation: Any) -> EnvReply:
    """The reply a remote client would parse from this observation's frame."""
    if type(observation) is TextObservation:  # its fields are JSON values already: no round trip
        fields = observation.__dict__
        return _text_reply({**fields, "metadata": dict(fields["metadata"])})
    return EnvReply.from_wire(json.loads(observation_frame(observation))["data"])
