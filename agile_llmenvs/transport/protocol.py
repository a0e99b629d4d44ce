"""The OpenEnv ``/ws`` wire protocol: message models, reply frames and error codes.

Incoming frames are parsed once, through ``extra="forbid"`` models and a union tagged on
``type``. Error codes cross the wire as strings and map to one exception type each on the
client (:func:`error_from_wire`), the inverse of :func:`code_for_exception` on the server.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from agile_llmenvs import errors
from agile_llmenvs.transport.types import TextObservation

__all__ = [
    "ErrorCode",
    "IncomingMessage",
    "code_for_exception",
    "error_frame",
    "error_from_wire",
    "observation_frame",
    "parse_message",
    "state_frame",
    "text_observation_frame",
]


class ErrorCode(StrEnum):
    """Codes of ``{"type": "error"}`` frames (OpenEnv's, plus ``MESSAGE_TOO_LARGE``)."""

    INVALID_JSON = "INVALID_JSON"
    UNKNOWN_TYPE = "UNKNOWN_TYPE"
    VALIDATION_ERROR = "VALIDATION_ERROR"
    EXECUTION_ERROR = "EXECUTION_ERROR"
    CAPACITY_REACHED = "CAPACITY_REACHED"
    FACTORY_ERROR = "FACTORY_ERROR"
    SESSION_ERROR = "SESSION_ERROR"
    MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ResetMessage(_Message):
    type: Literal["reset"]
    data: dict[str, Any] = Field(default_factory=dict)


class StepMessage(_Message):
    type: Literal["step"]
    data: dict[str, Any]


class StateMessage(_Message):
    type: Literal["state"]


class CloseMessage(_Message):
    type: Literal["close"]


IncomingMessage = Annotated[
    ResetMessage | StepMessage | StateMessage | CloseMessage, Field(discriminator="type")
]
_INCOMING: TypeAdapter[Any] = TypeAdapter(IncomingMessage)
_KNOWN_TYPES = ("reset", "step", "state", "close")


class WireError(Exception):
    """A frame that cannot be served; becomes an error frame, the session stays open."""

    def __init__(self, code: ErrorCode, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.extra = extra


def parse_message(raw: str) -> tuple[str, dict[str, Any]]:
    """Parse one text frame into its ``type`` and ``data`` (``{}`` for state and close).

    A well-formed step frame (``type`` and a ``data`` object, nothing else: nearly every
    frame) is taken as it is; any other frame is validated by the message models.

    Raises:
        WireError: invalid JSON, an unknown ``type``, or fields the type does not allow.
    """
    try:
        payload = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise WireError(ErrorCode.INVALID_JSON, f"Invalid JSON: {exc}") from None
    kind = payload.get("type") if isinstance(payload, dict) else None
    if kind == "step" and len(payload) == 2 and type(payload.get("data")) is dict:
        return kind, payload["data"]
    if kind not in _KNOWN_TYPES:
        raise WireError(ErrorCode.UNKNOWN_TYPE, f"Unknown message type: {kind}")
    try:
        message = _INCOMING.validate_python(payload)
    except ValidationError as exc:
        raise WireError(
            ErrorCode.VALIDATION_ERROR,
            "Invalid message",
            errors=json.loads(exc.json(include_url=False, include_context=False)),
        ) from None
    return message.type, getattr(message, "data", {})


def observation_frame(observation: BaseModel) -> str:
    """The ``observation`` reply for an OpenEnv observation (OpenEnv's own layout)."""
    if type(observation) is TextObservation:  # the hot path: its fields are JSON already
        o: Any = observation
        return text_observation_frame(
            prompt=o.prompt,
            reward=o.reward,
            done=o.done,
            truncated=o.truncated,
            question=o.question,
            answer=o.answer,
            metadata=o.metadata,
        )
    fields = observation.model_dump(mode="json", exclude={"reward", "done"})
    data: dict[str, Any] = {
        "observation": fields,
        "reward": observation.reward,  # type: ignore[attr-defined]
        "done": observation.done,  # type: ignore[attr-defined]
    }
    if fields.get("metadata"):
        data["metadata"] = fields["metadata"]
    return json.dumps({"type": "observation", "data": data})


def text_observation_frame(
    *,
    prompt: str,
    reward: float | None,
    done: bool,
    truncated: bool,
    question: Any,
    answer: Any,
    metadata: dict[str, Any],
) -> str:
    """The ``observation`` reply of a :class:`TextObservation` with these (JSON) fields."""
    fields = {
        "metadata": metadata,
        "prompt": prompt,
        "truncated": truncated,
        "question": question,
        "answer": answer,
    }
    data: dict[str, Any] = {"observation": fields, "reward": reward, "done": done}
    if metadata:
        data["metadata"] = metadata
    return json.dumps({"type": "observation", "data": data})


def state_frame(state: BaseModel) -> str:
    """The ``state`` reply."""
    return json.dumps({"type": "state", "data": state.model_dump(mode="json")})


def error_frame(code: ErrorCode | str, message: str, **extra: Any) -> str:
    """An ``error`` reply: ``{"type": "error", "data": {"message", "code", ...}}``."""
    return json.dumps({"type": "error", "data": {"message": message, "code": str(code), **extra}})


def code_for_exception(exc: BaseException) -> ErrorCode:
    """The wire code for an exception raised while serving a message."""
    if isinstance(exc, ValidationError):
        return ErrorCode.VALIDATION_ERROR
    if isinstance(exc, errors.EnvCapacityError):
        return ErrorCode.CAPACITY_REACHED
    if isinstance(exc, errors.EnvFactoryError):
        return ErrorCode.FACTORY_ERROR
    if isinstance(exc, errors.EnvProtocolError):
        return ErrorCode.VALIDATION_ERROR
    return ErrorCode.EXECUTION_ERROR


_ERROR_TYPES: dict[str, type[errors.EnvError]] = {
    ErrorCode.INVALID_JSON: errors.EnvProtocolError,
    ErrorCode.UNKNOWN_TYPE: errors.EnvProtocolError,
    ErrorCode.VALIDATION_ERROR: errors.EnvProtocolError,
    ErrorCode.MESSAGE_TOO_LARGE: errors.EnvProtocolError,
    ErrorCode.EXECUTION_ERROR: errors.EnvExecutionError,
    ErrorCode.CAPACITY_REACHED: errors.EnvCapacityError,
    ErrorCode.FACTORY_ERROR: errors.EnvFactoryError,
    ErrorCode.SESSION_ERROR: errors.EnvConnectionError,
}


def error_from_wire(data: dict[str, Any], *, url: str) -> errors.EnvError:
    """The typed exception for an ``error`` frame's ``data``."""
    code = str(data.get("code", "UNKNOWN"))
    message = str(data.get("message", "unknown error"))
    origin = data.get("error_type")
    where = f" (raised as {origin} in the env)" if origin else ""
    cls = _ERROR_TYPES.get(code, errors.EnvError)
    return cls(f"{url}: {message}{where} [code {code}]", code=code)
