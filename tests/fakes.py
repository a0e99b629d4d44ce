"""Shared test fakes: a deterministic text env, a call-counting backend wrapper, and a real
local HTTP server speaking OpenAI's chat-completions and Anthropic's messages wire shapes.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agile_llmenvs.backends import (
    Backend,
    Completion,
    HFBackend,
    Messages,
    SamplingParams,
    Tools,
)

# --------------------------------------------------------------------------- text env


class DigitEnv:
    """ "Say the digit d": row ``i`` asks for digit ``i % 10``, for ``turns(i)`` turns.

    Each turn pays 1.0 when the action, stripped, is the digit; the episode terminates after
    its turns whatever the policy says, so how long each task lasts is known in advance.
    Rows in ``bad_rows`` raise in ``reset``; rows in ``bad_steps`` raise in ``step``.
    """

    dataset_size = 10

    def __init__(
        self,
        turns: Callable[[int], int] = lambda row: 1,
        bad_rows: frozenset[int] = frozenset(),
        bad_steps: frozenset[int] = frozenset(),
    ) -> None:
        self.turns = turns
        self.bad_rows, self.bad_steps = bad_rows, bad_steps
        self.actions: list[str] = []
        self.reset_seeds: list[int | None] = []
        self.closed = False
        self.row = -1
        self._turn = 0

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        self.row = int(task.get("row_index", 0))
        self.reset_seeds.append(seed)
        if self.row in self.bad_rows:
            raise KeyError(f"row {self.row} is broken")
        self._turn = 0
        self.actions = []
        return self._prompt(), {"row_index": self.row, "seed": seed}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.row in self.bad_steps:
            raise RuntimeError(f"step of row {self.row} failed")
        self.actions.append(action)
        self._turn += 1
        reward = 1.0 if action.strip() == str(self.row % 10) else 0.0
        done = self._turn >= self.turns(self.row)
        return self._prompt(), reward, done, False, {"turn": self._turn}

    def close(self) -> None:
        self.closed = True

    def _prompt(self) -> str:
        return f"Say the digit {self.row % 10}."


@dataclass
class DigitEnvFactory:
    """Makes :class:`DigitEnv` instances and keeps every one it made (``made[0]`` is the
    probe that ``from_text_env`` reads the spec from)."""

    turns: Callable[[int], int] = lambda row: 1
    bad_rows: frozenset[int] = frozenset()
    bad_steps: frozenset[int] = frozenset()
    made: list[DigitEnv] = field(default_factory=list)

    def __call__(self) -> DigitEnv:
        env = DigitEnv(self.turns, self.bad_rows, self.bad_steps)
        self.made.append(env)
        return env


# --------------------------------------------------------------------------- backend wrapper


class CountingBackend:
    """Forwards to a real backend and records every call: ``(method, batch size)``."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.calls: list[tuple[str, int]] = []
        self.batches: list[list[Messages]] = []

    def generate_chat(self, messages: Messages, params: SamplingParams) -> Completion:
        self.calls.append(("generate_chat", 1))
        self.batches.append([messages])
        return self.inner.generate_chat(messages, params)

    def generate_chat_batch(
        self, batch: Sequence[Messages], params: SamplingParams
    ) -> list[Completion]:
        self.calls.append(("generate_chat_batch", len(batch)))
        self.batches.append(list(batch))
        return self.inner.generate_chat_batch(batch, params)

    def generate_with_tools_batch(
        self, batch: Sequence[Messages], tools: Tools, params: SamplingParams
    ) -> list[Completion]:
        self.calls.append(("generate_with_tools_batch", len(batch)))
        self.batches.append(list(batch))
        return self.inner.generate_with_tools_batch(batch, tools, params)

    def close(self) -> None:
        self.inner.close()


# --------------------------------------------------------------------------- API server

_DIGIT = re.compile(r"Say the digit (\d)\.")


def answer_digit(messages: list[dict[str, Any]]) -> str:
    """The server's default reply: the digit the last user turn asks for, else an echo."""
    last = next((m for m in reversed(messages) if m["role"] == "user"), {"content": ""})
    content = last["content"]
    text = content if isinstance(content, str) else str(content)
    match = _DIGIT.search(text)
    return match.group(1) if match else f"echo: {text}"


@dataclass
class Injection:
    """Answer the next ``times`` matching requests with HTTP ``status``."""

    status: int
    times: int = 1
    retry_after: str | None = None
    match: str | None = None  # only requests whose last message contains this


@dataclass
class SeenRequest:
    path: str
    body: dict[str, Any]
    arrived: float
    status: int = 200


class _HTTPProtocol(asyncio.Protocol):
    """HTTP/1.1 with keep-alive over one connection: requests with a Content-Length body."""

    def __init__(self, server: ChatAPIServer) -> None:
        self.server = server
        self.buffer = b""
        self.transport: Any = None
        self.pending: set[asyncio.Future[None]] = set()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].decode("latin-1").split("\r\n")
            headers = dict(line.split(":", 1) for line in head[1:] if ":" in line)
            headers = {k.strip().lower(): v.strip() for k, v in headers.items()}
            size = int(headers.get("content-length", "0"))
            if len(self.buffer) < end + 4 + size:
                return
            body = self.buffer[end + 4 : end + 4 + size]
            self.buffer = self.buffer[end + 4 + size :]
            method, path, _ = head[0].split(" ", 2)
            task = asyncio.ensure_future(self._respond(method, path, body))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)

    async def _respond(self, method: str, path: str, body: bytes) -> None:
        status, payload, headers = await self.server.handle(method, path, body)
        data = json.dumps(payload).encode()
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"]
        lines += [f"{k}: {v}" for k, v in {**headers, "content-type": "application/json"}.items()]
        lines.append(f"content-length: {len(data)}")
        if not self.transport.is_closing():
            self.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode() + data)


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found"}
_REASONS.update({429: "Too Many Requests", 500: "Internal Server Error", 503: "Unavailable"})


class ChatAPIServer:
    """A real HTTP server on 127.0.0.1 answering ``POST /v1/chat/completions`` (OpenAI) and
    ``POST /v1/messages`` (Anthropic) after ``latency_s``, with injectable error responses and
    a gauge of requests in flight. It runs its own event loop on a daemon thread.
    """

    def __init__(self, latency_s: float = 0.0) -> None:
        self.latency_s = latency_s
        self.reply: Callable[[list[dict[str, Any]]], str] = answer_digit
        self.tool_call: tuple[str, dict[str, Any]] | None = None  # answer with this call
        self.injections: list[Injection] = []
        self.requests: list[SeenRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def anthropic_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def clear(self, latency_s: float = 0.0) -> None:
        """Forget requests, injections and the gauge; restore the default reply."""
        self.latency_s = latency_s
        self.reply = answer_digit
        self.tool_call = None
        self.injections.clear()
        self.requests.clear()
        self.max_in_flight = 0

    def start(self) -> ChatAPIServer:
        loop = asyncio.new_event_loop()
        server = loop.run_until_complete(
            loop.create_server(lambda: _HTTPProtocol(self), "127.0.0.1", 0, backlog=1024)
        )
        self.port = server.sockets[0].getsockname()[1]
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> ChatAPIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _injection(self, messages: list[dict[str, Any]]) -> Injection | None:
        last = str(messages[-1]["content"]) if messages else ""
        for injection in self.injections:
            if injection.times > 0 and (injection.match is None or injection.match in last):
                injection.times -= 1
                return injection
        return None

    async def handle(
        self, method: str, path: str, raw: bytes
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        shapes = {"/v1/chat/completions": "openai", "/v1/messages": "anthropic"}
        if method != "POST" or path not in shapes:
            return 404, {"error": {"message": f"no route {method} {path}"}}, {}
        shape, body = shapes[path], json.loads(raw)
        seen = SeenRequest(path, body, time.monotonic())
        self.requests.append(seen)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.latency_s:
                await asyncio.sleep(self.latency_s)
            injection = self._injection(body["messages"])
            if injection is not None:
                seen.status = injection.status
                headers = {"retry-after": injection.retry_after} if injection.retry_after else {}
                return injection.status, _error(shape, injection.status), headers
            text = self.reply(body["messages"])
            build = _openai_reply if shape == "openai" else _anthropic_reply
            return 200, build(body, text, self.tool_call if body.get("tools") else None), {}
        finally:
            self.in_flight -= 1


def _error(shape: str, status: int) -> dict[str, Any]:
    kind = {429: "rate_limit_error", 401: "authentication_error", 400: "invalid_request_error"}
    error_type = kind.get(status, "api_error")
    message = f"injected {status}"
    if shape == "openai":
        return {"error": {"message": message, "type": error_type, "param": None, "code": None}}
    return {"type": "error", "error": {"type": error_type, "message": message}}


def _openai_reply(
    body: dict[str, Any], text: str, tool_call: tuple[str, dict[str, Any]] | None
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    finish = "stop"
    if tool_call is not None:
        name, arguments = tool_call
        function = {"name": name, "arguments": json.dumps(arguments)}
        message["tool_calls"] = [{"id": "call_0", "type": "function", "function": function}]
        finish = "tool_calls"
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": body["model"],
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def _anthropic_reply(
    body: dict[str, Any], text: str, tool_call: tuple[str, dict[str, Any]] | None
) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    stop_reason = "end_turn"
    if tool_call is not None:
        name, arguments = tool_call
        content.append({"type": "tool_use", "id": "toolu_0", "name": name, "input": arguments})
        stop_reason = "tool_use"
    return {
        "id": "msg_test",
        "type": "message",
        "role": "assistant",
        "model": body["model"],
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 1},
    }


# --------------------------------------------------------------------------- fixtures
# Test modules import these by name (``from fakes import hf_backend``) to use them.


@pytest.fixture(scope="module")
def hf_backend(tiny_model_dir: Path) -> Iterator[HFBackend]:
    """The tiny model behind a real :class:`HFBackend`."""
    backend = HFBackend(tiny_model_dir)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def api_server() -> Iterator[ChatAPIServer]:
    """A running :class:`ChatAPIServer`, cleared before each test that uses ``server``."""
    with ChatAPIServer() as server:
        yield server


@pytest.fixture
def server(api_server: ChatAPIServer) -> ChatAPIServer:
    """The module's API server, with no requests, injections or latency."""
    api_server.clear()
    return api_server


def digit_messages(*digits: int) -> list[list[dict[str, Any]]]:
    """One "say the digit" conversation per digit."""
    return [[{"role": "user", "content": f"Say the digit {d}."}] for d in digits]


#: Greedy, short: what runner tests sample with (the outputs do not matter there).
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
