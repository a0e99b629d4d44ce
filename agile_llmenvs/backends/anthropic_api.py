"""Anthropic's messages API through the ``anthropic`` SDK.

Conversations come in OpenAI's shape (the library's one message shape) and are translated
here: system messages become the ``system`` parameter, assistant tool calls become
``tool_use`` blocks and ``tool`` messages become ``tool_result`` blocks of a user turn.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from agile_llmenvs.backends.api import (
    APIBackend,
    APIFailure,
    aiohttp_client,
    translate_sdk_error,
)
from agile_llmenvs.backends.types import (
    Completion,
    FinishReason,
    Message,
    Messages,
    SamplingParams,
    ToolCall,
    Tools,
)
from agile_llmenvs.errors import OptionalDependencyError

__all__ = ["AnthropicBackend", "parse_message", "to_anthropic_messages", "to_anthropic_tools"]

_FINISH: dict[str | None, FinishReason] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
}


def _import_anthropic() -> Any:
    try:
        import anthropic
    except ImportError as exc:
        raise OptionalDependencyError("anthropic", extra="api", feature="AnthropicBackend") from exc
    return anthropic


def _assistant_blocks(message: Message) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for index, call in enumerate(message.get("tool_calls") or ()):
        function = call["function"]
        arguments = function.get("arguments") or "{}"
        blocks.append(
            {
                "type": "tool_use",
                "id": call.get("id") or f"call_{index}",
                "name": function["name"],
                "input": json.loads(arguments) if isinstance(arguments, str) else arguments,
            }
        )
    return blocks


def to_anthropic_messages(messages: Messages) -> tuple[str | None, list[dict[str, Any]]]:
    """``(system, messages)`` for the messages API from OpenAI-shaped ``messages``."""
    system = [str(m["content"]) for m in messages if m["role"] == "system"]
    turns: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        if role == "system":
            continue
        if role == "tool":
            block = {
                "type": "tool_result",
                "tool_use_id": message.get("tool_call_id", ""),
                "content": str(message["content"]),
            }
            turns.append({"role": "user", "content": [block]})
        elif role == "assistant" and message.get("tool_calls"):
            turns.append({"role": "assistant", "content": _assistant_blocks(message)})
        else:
            turns.append({"role": role, "content": message["content"]})
    return ("\n\n".join(system) if system else None), turns


def to_anthropic_tools(tools: Tools) -> list[dict[str, Any]]:
    """Anthropic tool definitions from OpenAI function tools (or Anthropic ones, as given)."""
    converted = []
    for tool in tools:
        function: Mapping[str, Any] = tool.get("function", tool)
        converted.append(
            {
                "name": function["name"],
                "description": function.get("description", ""),
                "input_schema": function.get("parameters")
                or function.get("input_schema")
                or {"type": "object", "properties": {}},
            }
        )
    return converted


def parse_message(payload: Mapping[str, Any]) -> Completion:
    """A :class:`Completion` from a messages response body."""
    texts, calls = [], []
    for block in payload.get("content") or ():
        if block.get("type") == "text":
            texts.append(str(block.get("text", "")))
        elif block.get("type") == "tool_use":
            arguments = block.get("input")
            calls.append(
                ToolCall(
                    str(block.get("name", "")),
                    arguments if isinstance(arguments, dict) else {},
                    id=block.get("id"),
                )
            )
    reason = _FINISH.get(payload.get("stop_reason"), "stop")
    return Completion("".join(texts), reason, tool_calls=tuple(calls))


class AnthropicBackend(APIBackend):
    """Messages from Anthropic, or any server speaking its API (``base_url``).

    Args:
        model: The model name (``"claude-sonnet-4-5"``).
        base_url: The API base URL (without ``/v1``); ``None`` is Anthropic's.
        api_key: The key; ``None`` reads ``ANTHROPIC_API_KEY`` (a ``base_url`` needs none).
        max_concurrency: Most requests in flight at once (default 64).
        config: Timeout, retry policy and headers.
    """

    api_key_env = "ANTHROPIC_API_KEY"

    def _make_client(self) -> Any:
        anthropic = _import_anthropic()
        return anthropic.AsyncAnthropic(
            api_key=self._api_key,
            base_url=self.base_url,
            timeout=self.config.timeout_s,
            max_retries=0,
            default_headers=dict(self.config.default_headers) or None,
            http_client=aiohttp_client(anthropic),
        )

    def request_body(
        self, messages: Messages, tools: Tools | None, params: SamplingParams
    ) -> dict[str, Any]:
        """The JSON body of one messages request.

        Sampling fields at the API's defaults are left out (recent models refuse
        ``temperature`` and ``top_p`` together).
        """
        system, turns = to_anthropic_messages(messages)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": turns,
            "max_tokens": params.max_tokens,
        }
        if params.temperature != 1.0:
            body["temperature"] = params.temperature
        if params.top_p < 1.0:
            body["top_p"] = params.top_p
        if params.top_k is not None:
            body["top_k"] = params.top_k
        if params.stop:
            body["stop_sequences"] = list(params.stop)
        if system is not None:
            body["system"] = system
        if tools:
            body["tools"] = to_anthropic_tools(tools)
        return body

    async def _request(
        self, messages: Messages, tools: Tools | None, params: SamplingParams
    ) -> Completion:
        body = self.request_body(messages, tools, params)
        payload = await self._client.post("/v1/messages", body=body, cast_to=object)
        return parse_message(payload)

    def _translate(self, exc: Exception) -> APIFailure | None:
        return translate_sdk_error(exc, _import_anthropic())
