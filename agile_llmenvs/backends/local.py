"""What the local backends share: chat on top of token-level ``generate``.

A local backend renders each conversation with the tokenizer's chat template, generates over
the ids in one batched call, and reads tool calls from the text in the Hermes/Qwen form
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from agile_llmenvs.backends.types import (
    Completion,
    FinishReason,
    Generation,
    Messages,
    SamplingParams,
    ToolCall,
    Tools,
)

__all__ = ["LocalChatBackend", "chat_completion", "cut_at_stop", "parse_tool_calls"]

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[ToolCall, ...]:
    """The well-formed ``<tool_call>`` blocks of ``text``; malformed ones are skipped.

    A model that writes broken JSON scores and continues: its text still reaches the env.
    """
    calls = []
    for match in _TOOL_CALL.finditer(text):
        try:
            payload = json.loads(match.group(1))
        except ValueError:
            continue
        if isinstance(payload, dict) and isinstance(payload.get("name"), str):
            arguments = payload.get("arguments", {})
            calls.append(
                ToolCall(payload["name"], arguments if isinstance(arguments, dict) else {})
            )
    return tuple(calls)


def cut_at_stop(
    token_ids: Sequence[int], tokenizer: Any, eos_ids: frozenset[int], stop: Sequence[str]
) -> tuple[int, str, bool]:
    """Where a sampled sequence ends: at its first end-of-turn id or first stop string.

    Returns:
        ``(n_tokens, text, stopped)``: how many ids to keep (an end-of-turn id is kept, as is
        the id that completed a stop string), the decoded text cut before any stop string,
        and whether either ended it.
    """
    end = next((i + 1 for i, tok in enumerate(token_ids) if tok in eos_ids), None)
    ids = list(token_ids[:end] if end is not None else token_ids)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    hits = [text.find(s) for s in stop if s and s in text]
    if not hits:
        return len(ids), text, end is not None
    # The shortest prefix whose text holds a stop string (monotone in the prefix length).
    low, high = 1, len(ids)
    while low < high:
        mid = (low + high) // 2
        prefix = tokenizer.decode(ids[:mid], skip_special_tokens=True)
        if any(s and s in prefix for s in stop):
            high = mid
        else:
            low = mid + 1
    return low, text[: min(hits)], True


class LocalChatBackend(ABC):
    """Chat-level generation for a backend that implements token-level :meth:`generate`."""

    @property
    @abstractmethod
    def tokenizer(self) -> Any:
        """The model's tokenizer, with a chat template."""

    @abstractmethod
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation]:
        """Sample one continuation per prompt of token ids, as one batched call."""

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release the backend's resources."""

    def encode_chat(self, messages: Messages, tools: Tools | None = None) -> list[int]:
        """The prompt ids of one conversation, ending with the assistant's generation prompt."""
        kwargs: dict[str, Any] = {"tools": list(tools)} if tools else {}
        ids = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **kwargs,
        )
        return [int(i) for i in ids]

    def generate_chat(self, messages: Messages, params: SamplingParams) -> Completion:
        """Generate one completion for one conversation."""
        return self.generate_chat_batch([messages], params)[0]

    def generate_chat_batch(
        self, batch: Sequence[Messages], params: SamplingParams
    ) -> list[Completion]:
        """Generate one completion per conversation with one batched :meth:`generate` call."""
        return self._chat([self.encode_chat(m) for m in batch], params)

    def generate_with_tools_batch(
        self, batch: Sequence[Messages], tools: Tools, params: SamplingParams
    ) -> list[Completion]:
        """As :meth:`generate_chat_batch`, with ``tools`` rendered by the chat template."""
        return self._chat([self.encode_chat(m, tools) for m in batch], params)

    def _chat(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if not prompts:
            return []
        return [chat_completion(g) for g in self.generate(prompts, params)]


def chat_completion(generation: Generation) -> Completion:
    """The chat completion of one generation: its text, and the tool calls parsed from it."""
    calls = parse_tool_calls(generation.text)
    reason: FinishReason = "tool_calls" if calls else generation.finish_reason
    return Completion(generation.text, reason, tool_calls=calls, generation=generation)
