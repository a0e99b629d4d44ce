"""API backends through the official SDKs against a real local HTTP server speaking the
OpenAI chat-completions and Anthropic messages wire shapes."""

from __future__ import annotations

import email.utils
import time

import pytest
from fakes import (
    ChatAPIServer,
    Injection,
    digit_messages,
)

from agile_llmenvs.backends import (
    AnthropicBackend,
    APIBackend,
    APIConfig,
    Backend,
    Completion,
    OpenAIBackend,
    OpenRouterBackend,
    RetryPolicy,
    SamplingParams,
    ToolCall,
)
from agile_llmenvs.backends.anthropic_api import to_anthropic_messages
from agile_llmenvs.backends.api import parse_retry_after
from agile_llmenvs.errors import BackendError

anthropic = pytest.importorskip("anthropic", reason="needs the `api` extra")
openai = pytest.importorskip("openai", reason="needs the `api` extra")

FAST_RETRY = APIConfig(retry=RetryPolicy(max_retries=3, initial_backoff_s=0.01, jitter=0.0))
PARAMS = SamplingParams(max_tokens=8, temperature=0.5, top_p=0.9, stop=("###",), seed=4)


def make(kind: str, server: ChatAPIServer, **kwargs: object) -> APIBackend:
    kwargs.setdefault("config", FAST_RETRY)
    if kind == "openai":
        return OpenAIBackend("gpt-test", base_url=server.openai_url, api_key="k", **kwargs)  # type: ignore[arg-type]
    return AnthropicBackend("claude-test", base_url=server.anthropic_url, api_key="k", **kwargs)  # type: ignore[arg-type]


BOTH = pytest.mark.parametrize("kind", ["openai", "anthropic"])


@BOTH
def test_batch_comes_back_in_order(kind: str, server: ChatAPIServer) -> None:
    backend = make(kind, server)
    try:
        assert isinstance(backend, Backend)
        completions = backend.generate_chat_batch(digit_messages(*range(10)), PARAMS)
    finally:
        backend.close()
    assert [c.text for c in completions] == [str(d) for d in range(10)]
    assert {c.finish_reason for c in completions} == {"stop"}
    assert len(server.requests) == 10


def test_openai_request_body(server: ChatAPIServer) -> None:
    backend = make("openai", server)
    messages = [{"role": "system", "content": "Be brief."}, *digit_messages(2)[0]]
    try:
        assert backend.generate_chat(messages, PARAMS) == Completion("2")
    finally:
        backend.close()
    (request,) = server.requests
    assert request.path == "/v1/chat/completions"
    assert request.body == {
        "model": "gpt-test",
        "messages": messages,
        "max_completion_tokens": 8,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop": ["###"],
        "seed": 4,
    }


def test_openrouter_request_body(server: ChatAPIServer) -> None:
    backend = OpenRouterBackend("meta/llama", base_url=server.openai_url, api_key="k")
    try:
        backend.generate_chat(digit_messages(1)[0], SamplingParams(max_tokens=3, top_k=5))
    finally:
        backend.close()
    body = server.requests[0].body
    assert (body["max_tokens"], body["top_k"]) == (3, 5)
    assert "max_completion_tokens" not in body


def test_anthropic_request_body(server: ChatAPIServer) -> None:
    backend = make("anthropic", server)
    messages = [{"role": "system", "content": "Be brief."}, *digit_messages(6)[0]]
    try:
        assert backend.generate_chat(messages, PARAMS) == Completion("6")
    finally:
        backend.close()
    (request,) = server.requests
    assert request.path == "/v1/messages"
    assert request.body == {
        "model": "claude-test",
        "messages": [{"role": "user", "content": "Say the digit 6."}],
        "max_tokens": 8,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop_sequences": ["###"],
        "system": "Be brief.",
    }


@BOTH
def test_5xx_is_retried_until_it_succeeds(kind: str, server: ChatAPIServer) -> None:
    server.injections.append(Injection(500, times=2))
    backend = make(kind, server)
    try:
        assert backend.generate_chat(digit_messages(8)[0], PARAMS).text == "8"
    finally:
        backend.close()
    assert [r.status for r in server.requests] == [500, 500, 200]


@BOTH
def test_429_waits_what_retry_after_asks(kind: str, server: ChatAPIServer) -> None:
    server.injections.append(Injection(429, times=1, retry_after="0.4"))
    server.injections.append(Injection(503, times=1))
    backend = make(kind, server)
    try:
        assert backend.generate_chat(digit_messages(4)[0], PARAMS).text == "4"
    finally:
        backend.close()
    first, second, third = server.requests
    assert [first.status, second.status, third.status] == [429, 503, 200]
    assert second.arrived - first.arrived >= 0.4  # Retry-After honoured
    assert third.arrived - second.arrived < 0.3  # no header: the 0.01 s backoff


@BOTH
def test_a_request_failing_past_its_retries_is_a_value(kind: str, server: ChatAPIServer) -> None:
    server.injections.append(Injection(500, times=10, match="digit 1"))
    backend = make(kind, server)
    try:
        completions = backend.generate_chat_batch(digit_messages(0, 1, 2), PARAMS)
    finally:
        backend.close()
    assert [c.text for c in completions] == ["0", "", "2"]
    assert completions[1] == Completion.failed(
        "gave up after 4 attempts; last: HTTP 500: injected 500"
    )
    assert sum(1 for r in server.requests if r.status == 500) == 4


@BOTH
def test_a_refused_request_raises_backend_error(kind: str, server: ChatAPIServer) -> None:
    # the refusal matches this test's own request: a request of an earlier test that the
    # server reads late (it was cancelled in flight) cannot take it
    mine = f"Refuse me ({kind})."
    server.injections.append(Injection(400, times=1, match=mine))
    backend = make(kind, server)
    try:
        with pytest.raises(
            BackendError,
            match=r"^\w+Backend request for model '\w+-test' was refused \(HTTP 400\): "
            r"injected 400$",
        ) as caught:
            backend.generate_chat_batch(
                [*digit_messages(1), [{"role": "user", "content": mine}]], PARAMS
            )
    finally:
        backend.close()
    assert caught.value.status_code == 400
    sdk = openai if kind == "openai" else anthropic
    assert isinstance(caught.value.__cause__, sdk.BadRequestError)


@BOTH
def test_the_semaphore_caps_requests_in_flight(kind: str, server: ChatAPIServer) -> None:
    server.latency_s = 0.1
    backend = make(kind, server, max_concurrency=4)
    try:
        start = time.monotonic()
        backend.generate_chat_batch(digit_messages(*range(16)), PARAMS)
        elapsed = time.monotonic() - start
    finally:
        backend.close()
    assert server.max_in_flight == 4
    assert elapsed >= 0.4  # 16 requests, 4 at a time, 0.1 s each


def test_requests_run_concurrently_up_to_the_limit(server: ChatAPIServer) -> None:
    server.latency_s = 0.2
    backend = make("openai", server)  # the default max_concurrency, 64
    try:
        assert backend.max_concurrency == 64
        start = time.monotonic()
        backend.generate_chat_batch(digit_messages(*range(10), *range(6)), PARAMS)
        elapsed = time.monotonic() - start
    finally:
        backend.close()
    assert server.max_in_flight == 16
    assert elapsed < 16 * 0.2 / 2


@BOTH
def test_tool_calls_come_back_structured(kind: str, server: ChatAPIServer) -> None:
    server.tool_call = ("lookup", {"key": "x"})
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Look a key up.",
                "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
            },
        }
    ]
    backend = make(kind, server)
    try:
        (completion,) = backend.generate_with_tools_batch(digit_messages(3), tools, PARAMS)
    finally:
        backend.close()
    call_id = "call_0" if kind == "openai" else "toolu_0"
    assert completion == Completion(
        "3", "tool_calls", tool_calls=(ToolCall("lookup", {"key": "x"}, id=call_id),)
    )
    sent = server.requests[0].body["tools"]
    if kind == "openai":
        assert sent == tools
    else:
        assert sent == [
            {
                "name": "lookup",
                "description": "Look a key up.",
                "input_schema": tools[0]["function"]["parameters"],  # type: ignore[index]
            }
        ]


def test_anthropic_translation_of_tool_turns() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    system, turns = to_anthropic_messages(
        [
            {"role": "system", "content": "S1"},
            {"role": "system", "content": "S2"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "calling", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ]
    )
    assert system == "S1\n\nS2"
    assert turns == [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "42"}],
        },
    ]


def test_a_missing_key_is_reported_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with pytest.raises(BackendError, match=r"^OpenAIBackend needs an API key: .*OPENAI_API_KEY"):
        OpenAIBackend("gpt-4o")
    monkeypatch.setenv("OPENAI_API_KEY", "an-openai-key")  # never used for OpenRouter
    with pytest.raises(BackendError, match=r"OPENROUTER_API_KEY\.$"):
        OpenRouterBackend("x/y")
    with pytest.raises(BackendError, match=r"ANTHROPIC_API_KEY\.$"):
        AnthropicBackend("claude")
    with pytest.raises(ValueError, match=r"^max_concurrency must be >= 1, got 0$"):
        OpenAIBackend("gpt-4o", max_concurrency=0)


def test_retry_after_forms() -> None:
    assert parse_retry_after({"Retry-After": "2"}) == 2.0
    assert parse_retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert parse_retry_after({}) is None
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 28 <= (parse_retry_after({"retry-after": later}) or 0) <= 30
    policy = RetryPolicy(initial_backoff_s=0.5, multiplier=2.0, max_backoff_s=3.0, jitter=0.0)
    assert [policy.delay(n, None) for n in range(4)] == [0.5, 1.0, 2.0, 3.0]
    assert policy.delay(0, 2.5) == 2.5  # a Retry-After under max_backoff_s, as asked


def test_requests_run_on_uvloop_when_it_is_installed(server: ChatAPIServer) -> None:
    uvloop = pytest.importorskip("uvloop")
    backend = OpenAIBackend("m", base_url=server.openai_url, api_key="k")
    try:
        asked = [{"role": "user", "content": "Say the digit 3."}]
        assert backend.generate_chat(asked, SamplingParams(max_tokens=4)).text == "3"
        assert isinstance(backend._loop._loop, uvloop.Loop)
    finally:
        backend.close()
