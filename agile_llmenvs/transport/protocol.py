"""The OpenEnv ``/ws`` wire protocol: message models, reply frames and error codes.

Incoming frames are parsed once, through ``extra="forbid"`` models and a union tagged on
``type``. Error codes cross the wire as strings and map to one exception type each on the
client (:func:`error_from_wire`), the inverse of :func:`code_for_exception` on the server.
"""

from __future__ import annotations

import json
import math
import os
import sysconfig
import traceback
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from agile_llmenvs import _json, errors
from agile_llmenvs.transport.types import TextObservation

__all__ = [
    "ErrorCode",
    "IncomingMessage",
    "code_for_exception",
    "error_frame",
    "error_from_wire",
    "exception_location",
    "holds_no_float",
    "observation_frame",
    "parse_message",
    "refuse_non_finite",
    "state_frame",
    "strict_json_loads",
    "text_observation_frame",
    "validation_errors",
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


class McpMessage(_Message):
    type: Literal["mcp"]
    data: dict[str, Any]


IncomingMessage = Annotated[
    ResetMessage | StepMessage | StateMessage | CloseMessage | McpMessage,
    Field(discriminator="type"),
]
_INCOMING: TypeAdapter[Any] = TypeAdapter(IncomingMessage)
_KNOWN_TYPES = ("reset", "step", "state", "close", "mcp")


class WireError(Exception):
    """A frame that cannot be served; becomes an error frame, the session stays open."""

    def __init__(self, code: ErrorCode, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.extra = extra


#: Writes JSON only: a non-finite float raises ``ValueError`` instead of writing ``NaN``; what
#: :func:`~agile_llmenvs._json.dumps` falls back to (compact, as its frames are).
_JSON_OUT = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


def strict_json_loads(raw: str | bytes) -> Any:
    """``json.loads`` that refuses the bare ``NaN``, ``Infinity`` and ``-Infinity`` (see
    :func:`~agile_llmenvs._json.loads`).

    Raises:
        json.JSONDecodeError: ``raw`` is not JSON.
        ValueError: ``raw`` holds one of those constants (the message names it), or nests
            deeper than the parser can recurse.
    """
    return _json.loads(raw)


def _dump_reply(
    frame: dict[str, Any], prefix: tuple[str, ...] = (), *, checked: bool = False
) -> str:
    """``frame`` as JSON text; a non-finite number in it is a :class:`WireError` naming its
    field, answered to the call that produced it (the encoder refuses non-finite floats, and
    only then is the frame searched). ``checked``: the caller has found it
    :func:`~agile_llmenvs._json.plain`."""
    try:
        return _json.dumps(frame, _JSON_OUT.encode, checked=checked)
    except ValueError:
        refuse_non_finite(frame.get("data"), prefix)
        raise


def refuse_non_finite(value: Any, prefix: tuple[str, ...] = ()) -> None:
    """Raise a :class:`WireError` naming the first non-finite number in ``value`` (dicts and
    lists, searched in order), if it has one: what every path refuses an env's reply for,
    hosted or in-process.
    """
    found = _non_finite(value, prefix)
    if found is None:
        return
    path, number = found
    name = _name_of_constant(number)
    raise WireError(
        ErrorCode.EXECUTION_ERROR,
        f"the env's {'.'.join(path)} is {name}: replies are JSON, which has no {name}; "
        "return a finite number",
    ) from None


def _name_of_constant(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


#: Values that hold no float: skipped without a call (nearly every value of an env's info).
_NO_FLOAT = frozenset({str, int, bool, type(None)})


def holds_no_float(mapping: dict[str, Any]) -> bool:
    """Whether every value of ``mapping`` is a str, int, bool or None (so it holds no
    non-finite number): the common env info, checked without a walk."""
    return all(type(value) in _NO_FLOAT for value in mapping.values())


def _non_finite(value: Any, path: tuple[str, ...]) -> tuple[tuple[str, ...], float] | None:
    """The path of the first non-finite float in ``value`` (dicts and lists), if any."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, value)
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if type(item) in _NO_FLOAT:
            continue
        found = _non_finite(item, (*path, str(key)))
        if found is not None:
            return found
    return None


def parse_message(raw: str) -> tuple[str, dict[str, Any]]:
    """Parse one text frame into its ``type`` and ``data`` (``{}`` for state and close).

    A well-formed step frame (``type`` and a ``data`` object, nothing else: nearly every
    frame) is taken as it is; any other frame is validated by the message models.

    Raises:
        WireError: invalid JSON (the bare ``NaN``/``Infinity`` included), an unknown
            ``type``, or fields the type does not allow.
    """
    try:
        payload = strict_json_loads(raw)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
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


def validation_errors(exc: ValidationError, *prefix: str) -> list[dict[str, Any]]:
    """A validation error's list as JSON data (what OpenEnv sends as ``exc.errors()``), each
    ``loc`` under ``prefix`` (FastAPI's ``body``, say)."""
    errors: list[dict[str, Any]] = json.loads(exc.json())
    for error in errors:
        error["loc"] = [*prefix, *error["loc"]]
    return errors


def observation_frame(observation: BaseModel) -> str:
    """The ``observation`` reply for an OpenEnv observation (OpenEnv's own layout).

    Raises:
        WireError: a non-finite number in the observation: JSON has none.
    """
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
            images=o.images,
        )
    # JSON mode writes a non-finite float as null, which no env means: refuse one first
    refuse_non_finite(observation.model_dump(exclude={"reward", "done"}), ("observation",))
    fields = observation.model_dump(mode="json", exclude={"reward", "done"})
    data: dict[str, Any] = {
        "observation": fields,
        "reward": observation.reward,  # type: ignore[attr-defined]
        "done": observation.done,  # type: ignore[attr-defined]
    }
    if fields.get("metadata"):
        data["metadata"] = fields["metadata"]
    return _dump_reply({"type": "observation", "data": data})


_TEXT_OR_NONE = frozenset({str, type(None)})


def text_observation_frame(
    *,
    prompt: str,
    reward: float | None,
    done: bool,
    truncated: bool,
    question: Any,
    answer: Any,
    metadata: dict[str, Any],
    images: list[str] | None = None,
) -> str:
    """The ``observation`` reply of a :class:`TextObservation` with these (JSON) fields.

    ``images`` (base64 PNGs) travel only when there are some, so a text env's frames stay as
    they were.

    Raises:
        WireError: a non-finite number (``reward`` NaN, say) in them: JSON has none.
    """
    fields = {
        "metadata": metadata,
        "prompt": prompt,
        "truncated": truncated,
        "question": question,
        "answer": answer,
    }
    if images:
        fields["images"] = images
    data: dict[str, Any] = {"observation": fields, "reward": reward, "done": done}
    if metadata:
        data["metadata"] = metadata
    checked = (  # the common reply, checked without walking it (see _json.plain)
        type(prompt) is str
        and (reward is None or (type(reward) is float and reward - reward == 0.0))
        and type(done) is bool
        and type(truncated) is bool
        and type(question) in _TEXT_OR_NONE
        and type(answer) in _TEXT_OR_NONE
        and (not metadata or _json.plain(metadata))
        and (not images or _json.plain(images))
    )
    return _dump_reply({"type": "observation", "data": data}, checked=checked)


def state_frame(state: BaseModel) -> str:
    """The ``state`` reply.

    Raises:
        WireError: a non-finite number in the state: JSON has none.
    """
    return _dump_reply({"type": "state", "data": state.model_dump(mode="json")}, ("state",))


def error_frame(code: ErrorCode | str, message: str, **extra: Any) -> str:
    """An ``error`` reply: ``{"type": "error", "data": {"message", "code", ...}}``.

    Extra fields that are not JSON (a non-finite number) are left out, never the reply.
    """
    frame = {"type": "error", "data": {"message": message, "code": str(code), **extra}}
    try:
        return _json.dumps(frame, _JSON_OUT.encode)
    except ValueError:
        return _JSON_OUT.encode({"type": "error", "data": {"message": message, "code": str(code)}})


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
    details = data.get("errors")
    if isinstance(details, list):  # a validation error: say which field and why
        for error in details:
            if isinstance(error, dict):
                where = ".".join(str(part) for part in error.get("loc", ()))
                message += f"\n{where}\n  {error.get('msg', '')}"
    origin = data.get("error_type")
    location = data.get("location")
    at = f" at {location}" if isinstance(location, str) and location else " in the env"
    where = f" (raised as {origin}{at})" if origin else ""
    cls = _ERROR_TYPES.get(code, errors.EnvError)
    field_errors = None
    if isinstance(details, list):
        field_errors = [error for error in details if isinstance(error, dict)]
    return cls(f"{url}: {message}{where} [code {code}]", code=code, field_errors=field_errors)


# Where an env's bug is not: this package's frames, and (unless nothing else is left) the
# standard library's and installed packages'.
_PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "")
_LIBRARY_DIRS = tuple(
    os.path.join(os.path.realpath(folder), "")
    for folder in {sysconfig.get_paths().get(key) for key in ("stdlib", "purelib", "platlib")}
    if folder
)


def exception_location(exc: BaseException) -> str | None:
    """Where an env's exception was raised, as ``guess_env.py:12 in step``: the innermost
    frame of its traceback outside this package, the standard library and installed
    packages (else the innermost outside this package); ``None`` when there is none.

    A file under the working directory is named relative to it.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    outside = [f for f in frames if not _under(f.filename, _PACKAGE_DIR)]
    own = [f for f in outside if not any(_under(f.filename, d) for d in _LIBRARY_DIRS)]
    chosen = own or outside
    if not chosen:
        return None
    frame = chosen[-1]
    filename = frame.filename
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive
        relative = filename
    if not relative.startswith(os.pardir):
        filename = relative
    return f"{filename}:{frame.lineno} in {frame.name}"


def _under(filename: str, folder: str) -> bool:
    return os.path.realpath(filename).startswith(folder)
