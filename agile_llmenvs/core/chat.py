"""The chat vocabulary every layer speaks: messages, tool calls and what a generation returns.

Backends produce :class:`Completion` values; runners, the state-passing
:mod:`~agile_llmenvs.core.types` face and the text-env runtime read them. Nothing here imports
a backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "Completion",
    "FinishReason",
    "Generation",
    "Message",
    "Messages",
    "ToolCall",
    "Tools",
]

Message = Mapping[str, Any]
"""One chat message, OpenAI-shaped: ``{"role": ..., "content": ...}``."""
Messages = Sequence[Message]
Tools = Sequence[Mapping[str, Any]]
"""Tool descriptions in OpenAI's function shape: ``{"type": "function", "function": {...}}``."""

FinishReason = Literal["stop", "length", "tool_calls", "error"]


@dataclass(frozen=True)
class Generation:
    """What a token-level backend sampled for one prompt.

    Attributes:
        token_ids: The sampled ids, in order, including a final end-of-turn id when sampled.
        logprobs: The model's log-probability of each sampled id (same length).
        text: ``token_ids`` decoded, special tokens skipped, cut before any stop string.
        finish_reason: ``"stop"`` (end-of-turn id or stop string) or ``"length"``.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish_reason: FinishReason


@dataclass(frozen=True)
class ToolCall:
    """A tool call the model asked for."""

    name: str
    arguments: Mapping[str, Any]
    id: str | None = None


@dataclass(frozen=True)
class Completion:
    """One chat-level completion.

    A request that failed past its retries is a value, not an exception that sinks the whole
    batch: ``finish_reason == "error"`` and ``error`` says why.

    Attributes:
        text: The assistant's text.
        finish_reason: Why generation ended.
        tool_calls: Tool calls the model made, in order.
        generation: The token-level result, from local backends only.
        error: What went wrong, when ``finish_reason == "error"``.
    """

    text: str
    finish_reason: FinishReason = "stop"
    tool_calls: tuple[ToolCall, ...] = field(default=())
    generation: Generation | None = None
    error: str | None = None

    @classmethod
    def failed(cls, error: str) -> Completion:
        """A completion standing for a request that failed."""
        return cls(text="", finish_reason="error", error=error)
