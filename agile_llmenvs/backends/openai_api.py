"""OpenAI's chat-completions API (and OpenRouter, which speaks it) through the ``openai`` SDK.

Requests go through the SDK's client (its auth, headers, base URL, error types and, when
``aiohttp`` is installed, its aiohttp transport) as plain JSON: the body is built here, so the
SDK's per-call parameter transform, about a millisecond a request, is skipped.
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
    Messages,
    SamplingParams,
    ToolCall,
    Tools,
)
from agile_llmenvs.errors import BackendError, OptionalDependencyError

__all__ = ["OpenAIBackend", "OpenRouterBackend", "parse_chat_completion"]

_FINISH: dict[str | None, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
}


def _import_openai() -> Any:
    try:
        import openai
    except ImportError as exc:
        raise OptionalDependencyError("openai", extra="api", feature="OpenAIBackend") from exc
    return openai


def _tool_call(call: Mapping[str, Any]) -> ToolCall:
    function = call.get("function") or {}
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except ValueError:  # malformed JSON from the model scores and continues
        arguments = {}
    return ToolCall(
        str(function.get("name", "")),
        arguments if isinstance(arguments, dict) else {},
        id=call.get("id"),
    )


def parse_chat_completion(payload: Mapping[str, Any]) -> Completion:
    """A :class:`Completion` from a chat-completions response body.

    Raises:
        BackendError: The body has no choices.
    """
    choices = payload.get("choices") or []
    if not choices:
        raise BackendError(f"a chat completion with no choices came back: {payload!r:.300}")
    message = choices[0].get("message") or {}
    calls = tuple(_tool_call(c) for c in message.get("tool_calls") or ())
    reason = _FINISH.get(choices[0].get("finish_reason"), "stop")
    return Completion(message.get("content") or "", reason, tool_calls=calls)


class OpenAIBackend(APIBackend):
    """Chat completions from OpenAI, or any server speaking its API (``base_url``).

    ``top_k`` is not part of OpenAI's API and is not sent.

    Args:
        model: The model name (``"gpt-4o"``).
        base_url: The API base URL, ending in ``/v1``; ``None`` is OpenAI's.
        api_key: The key; ``None`` reads ``OPENAI_API_KEY`` (a ``base_url`` needs none).
        max_concurrency: Most requests in flight at once (default 64).
        config: Timeout, retry policy and headers.
    """

    api_key_env = "OPENAI_API_KEY"
    _default_base_url: str | None = None

    def _make_client(self) -> Any:
        openai = _import_openai()
        return openai.AsyncOpenAI(
            api_key=self._api_key,
            base_url=self.base_url or self._default_base_url,
            timeout=self.config.timeout_s,
            max_retries=0,
            default_headers=dict(self.config.default_headers) or None,
            http_client=aiohttp_client(openai),
        )

    def request_body(
        self, messages: Messages, tools: Tools | None, params: SamplingParams
    ) -> dict[str, Any]:
        """The JSON body of one chat-completions request."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [dict(m) for m in messages],
            "max_completion_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
        }
        if params.stop:
            body["stop"] = list(params.stop)
        if params.seed is not None:
            body["seed"] = params.seed
        if tools:
            body["tools"] = [dict(t) for t in tools]
        return body

    async def _request(
        self, messages: Messages, tools: Tools | None, params: SamplingParams
    ) -> Completion:
        body = self.request_body(messages, tools, params)
        payload = await self._client.post("/chat/completions", body=body, cast_to=object)
        return parse_chat_completion(payload)

    def _translate(self, exc: Exception) -> APIFailure | None:
        return translate_sdk_error(exc, _import_openai())


class OpenRouterBackend(OpenAIBackend):
    """Chat completions from OpenRouter's OpenAI-compatible API.

    Sends ``max_tokens`` (and ``top_k`` when set), as OpenRouter documents them.

    Args:
        model: The OpenRouter model name (``"meta-llama/llama-3.1-8b-instruct"``).
        base_url: The API base URL; ``None`` is OpenRouter's.
        api_key: The key; ``None`` reads ``OPENROUTER_API_KEY`` (never ``OPENAI_API_KEY``).
        max_concurrency: Most requests in flight at once (default 64).
        config: Timeout, retry policy and headers.
    """

    api_key_env = "OPENROUTER_API_KEY"
    _default_base_url = "https://openrouter.ai/api/v1"

    def request_body(
        self, messages: Messages, tools: Tools | None, params: SamplingParams
    ) -> dict[str, Any]:
        """The JSON body of one request, in OpenRouter's spelling."""
        body = super().request_body(messages, tools, params)
        body["max_tokens"] = body.pop("max_completion_tokens")
        if params.top_k is not None:
            body["top_k"] = params.top_k
        return body
