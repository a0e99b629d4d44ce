"""Parse the tool calls a model writes into its completion, in the format its family emits.

The completion is decoded with its special tokens kept and may end in an end-of-turn token
(``<|im_end|>``, ``<|eot_id|>``, ``</s>``, ...), which every parser tolerates. Choose the parser
by name (:data:`TOOL_CALL_PARSERS`):

``hermes`` (Qwen2.5, Qwen3, Hermes): any number of blocks anywhere in the text::

    Let me look. <tool_call>{"name": "search", "arguments": {"q": "cats"}}</tool_call>

``llama3_json`` (Llama-3.1 / 3.2 JSON tool calling): the whole text is one JSON object, or
several separated by ``;``, optionally after ``<|python_tag|>``::

    <|python_tag|>{"name": "search", "parameters": {"q": "cats"}}

``mistral``: ``[TOOL_CALLS]`` then a JSON list of calls (v3), or ``name[ARGS]{json}`` after
each ``[TOOL_CALLS]`` marker (v11); text before the first marker is content::

    [TOOL_CALLS][{"name": "search", "arguments": {"q": "cats"}}]
    [TOOL_CALLS]search[ARGS]{"q": "cats"}

``pythonic`` (Llama-3.2 / Llama-4, vLLM's "pythonic"): the whole text is a Python list of calls
with keyword arguments whose values are literals, optionally inside
``<|python_start|>...<|python_end|>``; it is read with :mod:`ast`, never evaluated::

    [search(q="cats", limit=3), weather(city="Paris")]

Calls inside a reasoning block (``<think>...</think>`` by default) are not calls: the parser
reads the text with the reasoning removed (:func:`strip_reasoning`).
"""

from __future__ import annotations

import ast
import contextlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "TOOL_CALL_PARSERS",
    "ParsedAction",
    "ToolCall",
    "parse_tool_calls",
    "strip_reasoning",
]

_THINK = ("<think>", "</think>")
_END_OF_TURN = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|eot|>",
    "<|eom|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
)
_HERMES_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.S)
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_CALLS, _MISTRAL_ARGS, _MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: a tool name and its JSON-object arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedAction:
    """The tool calls found in a completion, or why they are malformed.

    Attributes:
        calls: Well-formed calls, in order (when ``error`` is set: the ones before the bad one).
        error: Why a tool call could not be parsed (None when all parsed).
    """

    calls: tuple[ToolCall, ...] = ()
    error: str | None = None

    @property
    def has_calls(self) -> bool:
        """Whether the completion tried to call a tool at all."""
        return bool(self.calls) or self.error is not None


def strip_reasoning(
    text: str,
    delimiters: tuple[str, str] = _THINK,
    *,
    starts_in_reasoning: bool = False,
) -> str:
    """Remove the reasoning from ``text``; what is left is returned verbatim (not stripped).

    When the text starts inside reasoning (``starts_in_reasoning``, as when the chat template
    already opened the block, or the text's first non-space characters are the open
    delimiter), everything up to and including the first close delimiter goes. Every later
    open...close block goes too; an open delimiter that is never closed takes the rest of the
    text with it.

    Args:
        text: The completion.
        delimiters: The open and close delimiters of a reasoning block.
        starts_in_reasoning: Whether the text begins inside an already opened block.

    Returns:
        The text without its reasoning.

    Raises:
        ValueError: If a delimiter is empty.
    """
    open_, close = delimiters
    if not open_ or not close:
        raise ValueError("the reasoning delimiters must not be empty")
    if starts_in_reasoning or text.lstrip().startswith(open_):
        start = text.find(open_) + len(open_) if not starts_in_reasoning else 0
        end = text.find(close, start)
        if end < 0:
            return ""
        text = text[end + len(close) :]
    kept: list[str] = []
    position = 0
    while (start := text.find(open_, position)) >= 0:
        kept.append(text[position:start])
        end = text.find(close, start + len(open_))
        if end < 0:
            return "".join(kept)
        position = end + len(close)
    kept.append(text[position:])
    return "".join(kept)


def parse_tool_calls(
    text: str,
    parser: str = "hermes",
    *,
    reasoning: tuple[str, str] | None = _THINK,
    starts_in_reasoning: bool = False,
) -> ParsedAction:
    """Find the tool calls in a completion.

    One malformed call makes the whole action malformed: the caller must not send a
    half-understood action to the env.

    Args:
        text: The completion, decoded with its special tokens kept.
        parser: The format, one of :data:`TOOL_CALL_PARSERS`.
        reasoning: The reasoning delimiters; calls inside reasoning are ignored (see
            :func:`strip_reasoning`). None reads the whole text.
        starts_in_reasoning: Whether the text begins inside an already opened reasoning block
            (ignored when ``reasoning`` is None).

    Returns:
        The calls, in order, or why they are malformed.

    Raises:
        ValueError: If ``parser`` is not a known parser.
    """
    parse = _PARSERS.get(parser)
    if parse is None:
        known = ", ".join(TOOL_CALL_PARSERS)
        raise ValueError(f"unknown tool-call parser {parser!r} (known parsers: {known})")
    if reasoning is not None:
        text = strip_reasoning(text, reasoning, starts_in_reasoning=starts_in_reasoning)
    return parse(_trim(text))


# -- the parsers (each takes the trimmed text without its reasoning) ---------------------------


def _parse_hermes(text: str) -> ParsedAction:
    calls: list[ToolCall] = []
    for match in _HERMES_CALL.finditer(text):
        body, closing = match.group(1).strip(), match.group(2)
        if not closing:
            return ParsedAction(tuple(calls), "a <tool_call> block is not closed")
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as exc:
            return ParsedAction(tuple(calls), _not_json(exc))
        call = _json_call(payload, ("arguments",))
        if isinstance(call, str):
            return ParsedAction(tuple(calls), call)
        calls.append(call)
    return ParsedAction(tuple(calls))


def _parse_llama3_json(text: str) -> ParsedAction:
    if text.startswith(_PYTHON_TAG):
        text = text[len(_PYTHON_TAG) :].lstrip()
    elif not text.startswith("{"):
        return ParsedAction()
    calls: list[ToolCall] = []
    decoder, position = json.JSONDecoder(), 0
    while True:
        try:
            payload, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as exc:
            return ParsedAction(tuple(calls), _not_json(exc))
        call = _json_call(payload, ("parameters", "arguments"))
        if isinstance(call, str):
            return ParsedAction(tuple(calls), call)
        calls.append(call)
        rest = text[position:].lstrip()
        if not rest or rest == ";":
            return ParsedAction(tuple(calls))
        if not rest.startswith(";"):
            return ParsedAction(tuple(calls), 'the tool calls must be separated by ";"')
        text, position = rest[1:].lstrip(), 0


def _parse_mistral(text: str) -> ParsedAction:
    if _MISTRAL_CALLS not in text:
        return ParsedAction()
    calls: list[ToolCall] = []
    for segment in text.split(_MISTRAL_CALLS)[1:]:
        found, error = _mistral_calls(segment.strip())
        calls.extend(found)
        if error is not None:
            return ParsedAction(tuple(calls), error)
    return ParsedAction(tuple(calls))


def _parse_pythonic(text: str) -> ParsedAction:
    if text.startswith(_PYTHON_START):
        text = text[len(_PYTHON_START) :].removesuffix(_PYTHON_END).strip()
    elif not text.startswith("["):
        return ParsedAction()
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        return ParsedAction((), f"the tool calls are not valid Python ({exc.msg})")
    except ValueError as exc:  # e.g. a null byte
        return ParsedAction((), f"the tool calls are not valid Python ({exc})")
    if not isinstance(tree.body, ast.List):
        return ParsedAction((), "the tool calls must be a Python list of calls")
    calls: list[ToolCall] = []
    for node in tree.body.elts:
        call = _pythonic_call(node)
        if isinstance(call, str):
            return ParsedAction(tuple(calls), call)
        calls.append(call)
    return ParsedAction(tuple(calls))


_PARSERS: dict[str, Callable[[str], ParsedAction]] = {
    "hermes": _parse_hermes,
    "llama3_json": _parse_llama3_json,
    "mistral": _parse_mistral,
    "pythonic": _parse_pythonic,
}

TOOL_CALL_PARSERS: tuple[str, ...] = tuple(_PARSERS)
"""The names :func:`parse_tool_calls` accepts as ``parser``."""


# -- helpers ----------------------------------------------------------------------------------


def _trim(text: str) -> str:
    """The text without surrounding whitespace and trailing end-of-turn tokens."""
    text = text.strip()
    while token := next((t for t in _END_OF_TURN if text.endswith(t)), None):
        text = text[: -len(token)].rstrip()
    return text


def _not_json(exc: json.JSONDecodeError) -> str:
    return f"the tool call is not valid JSON ({exc.msg})"


def _json_call(payload: Any, argument_keys: tuple[str, ...]) -> ToolCall | str:
    """A call from a decoded JSON object, or why it is not one; the arguments are read from the
    first of ``argument_keys`` present (default: no arguments)."""
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return 'the tool call needs a string "name"'
    key = next((k for k in argument_keys if k in payload), argument_keys[0])
    arguments = payload.get(key, {})
    if isinstance(arguments, str):  # some models emit the arguments JSON as a string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return f'the tool call\'s "{key}" must be an object'
    return ToolCall(payload["name"], arguments)


def _mistral_calls(segment: str) -> tuple[list[ToolCall], str | None]:
    """The calls after one ``[TOOL_CALLS]`` marker (v3 JSON or v11 ``name[ARGS]{json}``), and
    why the next one is malformed (None when all parsed)."""
    if not segment:
        return [], "a [TOOL_CALLS] marker is followed by no call"
    if segment.startswith(("[", "{")) and not segment.startswith((_MISTRAL_ARGS, _MISTRAL_CALL_ID)):
        try:
            payload = json.loads(segment)
        except json.JSONDecodeError as exc:
            return [], _not_json(exc)
        calls: list[ToolCall] = []
        for item in payload if isinstance(payload, list) else [payload]:
            call = _json_call(item, ("arguments",))
            if isinstance(call, str):
                return calls, call
            calls.append(call)
        return calls, None
    head, marker, body = segment.partition(_MISTRAL_ARGS)
    if not marker:
        return [], "a [TOOL_CALLS] call has no [ARGS]"
    name = head.partition(_MISTRAL_CALL_ID)[0].strip()
    if not name:
        return [], "a [TOOL_CALLS] call needs a name before [ARGS]"
    try:
        arguments = json.loads(body)
    except json.JSONDecodeError as exc:
        return [], _not_json(exc)
    if not isinstance(arguments, dict):
        return [], f"the arguments of {name} must be a JSON object"
    return [ToolCall(name, arguments)], None


def _pythonic_call(node: ast.expr) -> ToolCall | str:
    """A call from one element of the list, or why it is not one."""
    if not isinstance(node, ast.Call):
        return "the tool calls must be a Python list of calls"
    if not isinstance(node.func, ast.Name):
        return f"a tool call must name a plain function, not {ast.unparse(node.func)}"
    name = node.func.id
    if node.args:
        return f"the call to {name} has a positional argument (only keyword arguments are allowed)"
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return f"the call to {name} unpacks ** (only keyword arguments are allowed)"
        if keyword.arg in arguments:
            return f"the call to {name} repeats the argument {keyword.arg}"
        source = ast.unparse(keyword.value)
        try:
            arguments[keyword.arg] = ast.literal_eval(_JsonNames().visit(keyword.value))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return f"the argument {keyword.arg} of {name} is not a literal ({source})"
    return ToolCall(name, arguments)


class _JsonNames(ast.NodeTransformer):
    """Read the JSON names ``true``, ``false`` and ``null`` as Python's True, False, None."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in _JSON_NAMES:
            return ast.copy_location(ast.Constant(_JSON_NAMES[node.id]), node)
        return node
