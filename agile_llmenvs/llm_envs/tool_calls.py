"""Parse the model's tool calls: the ``<tool_call>{json}</tool_call>`` style of Qwen / Hermes."""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ParsedAction", "ToolCall", "parse_tool_calls"]

_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: a tool name and its JSON-object arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedAction:
    """The tool calls found in a completion, or why they are malformed.

    Attributes:
        calls: Well-formed calls, in order.
        error: Why a ``<tool_call>`` block could not be parsed (None when all parsed).
    """

    calls: tuple[ToolCall, ...] = ()
    error: str | None = None

    @property
    def has_calls(self) -> bool:
        """Whether the completion tried to call a tool at all."""
        return bool(self.calls) or self.error is not None


def parse_tool_calls(text: str) -> ParsedAction:
    """Find ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in ``text``.

    A block with invalid JSON, no ``name``, non-object ``arguments`` or no closing tag makes
    the whole action malformed: the caller must not send a half-understood action to the env.
    """
    calls: list[ToolCall] = []
    for match in _CALL.finditer(text):
        body, closing = match.group(1).strip(), match.group(2)
        if not closing:
            return ParsedAction(tuple(calls), "a <tool_call> block is not closed")
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as exc:
            return ParsedAction(tuple(calls), f"the tool call is not valid JSON ({exc.msg})")
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return ParsedAction(tuple(calls), 'the tool call needs a string "name"')
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # some models emit the arguments JSON as a string
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            return ParsedAction(tuple(calls), 'the tool call\'s "arguments" must be an object')
        calls.append(ToolCall(payload["name"], arguments))
    return ParsedAction(tuple(calls))
