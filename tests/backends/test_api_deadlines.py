"""Every API call ends within its deadline, whatever the server does: ``timeout_s`` bounds
the whole call (attempts and the waits between them), and a ``Retry-After`` waits at most the
retry policy's longest wait. Each hostile server is a real socket on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
from fakes import digit_messages

from agile_llmenvs.backends import (
    AnthropicBackend,
    APIBackend,
    APIConfig,
    OpenAIBackend,
    RetryPolicy,
    SamplingParams,
)

pytest.importorskip("anthropic", reason="needs the `api` extra")
pytest.importorskip("openai", reason="needs the `api` extra")

PARAMS = SamplingParams(max_tokens=8)
TIMEOUT_S = 3.0
#: What a call may take beyond its deadline: the event loop's wake-up and the cancel.
SLACK_S = 1.0
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class HostileServer:
    """A TCP server on 127.0.0.1 whose every connection ``handler`` serves, on a loop of its
    own; it counts the requests that arrived."""

    def __init__(self, handler: Handler) -> None:
        self.handler, self.requests, self.port = handler, 0, 0
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(5)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                while True:  # keep-alive: a retry may come on the same connection
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = next(
                        (
                            int(line.split(b":")[1])
                            for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-length:")
                        ),
                        0,
                    )
                    await reader.readexactly(length)
                    self.requests += 1
                    await self.handler(reader, writer)

        server = self._loop.run_until_complete(asyncio.start_server(serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        """Cancel the connections still served, then stop the loop: a task left pending
        logs "Task was destroyed but it is pending!" when it is collected, in whichever
        test runs then."""

        async def cancel_connections() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_connections(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)


def _error_body(status: int, retry_after: str) -> bytes:
    body = json.dumps({"error": {"message": "slow down", "type": "rate_limit"}}).encode()
    return (
        f"HTTP/1.1 {status} Too Many Requests\r\nContent-Type: application/json\r\n"
        f"Retry-After: {retry_after}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def _rate_limited(retry_after: str) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_error_body(429, retry_after))
        await writer.drain()

    return handler


async def _trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A 200 whose body comes one byte a second (each read is quick; the whole is not)."""
    body = b'{"id": "x", "choices": []}' * 100
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
    )
    for byte in body:
        writer.write(bytes([byte]))
        await writer.drain()
        await asyncio.sleep(1.0)


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(3600)


@pytest.fixture
def hostile() -> Iterator[Callable[[Handler], HostileServer]]:
    servers: list[HostileServer] = []

    def start(handler: Handler) -> HostileServer:
        servers.append(HostileServer(handler))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _backend(kind: str, port: int) -> APIBackend:
    # the SDK's own per-read timeout is the same timeout_s: a trickle never trips it
    config = APIConfig(timeout_s=TIMEOUT_S, retry=RetryPolicy(max_retries=2))
    if kind == "openai":
        return OpenAIBackend(
            "m", base_url=f"http://127.0.0.1:{port}/v1", api_key="k", config=config
        )
    return AnthropicBackend("m", base_url=f"http://127.0.0.1:{port}", api_key="k", config=config)


BOTH = pytest.mark.parametrize("kind", ["openai", "anthropic"])


@BOTH
@pytest.mark.parametrize("retry_after", ["100000", "inf", "nan", "-5"])
def test_a_retry_after_waits_at_most_the_longest_wait(
    kind: str, retry_after: str, hostile: Callable[[Handler], HostileServer]
) -> None:
    server = hostile(_rate_limited(retry_after))
    backend = _backend(kind, server.port)
    start = time.monotonic()
    try:
        [completion] = backend.generate_chat_batch(digit_messages(1), PARAMS)
    finally:
        backend.close()
    took = time.monotonic() - start
    assert completion.finish_reason == "error"
    assert took < TIMEOUT_S + SLACK_S, took
    if retry_after in ("100000", "inf"):  # capped at max_backoff_s (30 s): past the deadline
        assert server.requests == 1
        assert completion.error == (
            f"no answer within timeout_s={TIMEOUT_S:g} s, the deadline of the whole call (1 "
            "attempt; last: HTTP 429: slow down; the next retry after 30 s)"
        )
    else:  # not a wait: the policy's own backoff (0.5 s, then 1 s), every retry made
        assert server.requests == 3
        assert completion.error == "gave up after 3 attempts; last: HTTP 429: slow down"


@BOTH
@pytest.mark.parametrize("behaviour", ["trickle", "silent"])
def test_a_server_that_trickles_or_never_answers_ends_at_the_deadline(
    kind: str, behaviour: str, hostile: Callable[[Handler], HostileServer]
) -> None:
    server = hostile(_trickle if behaviour == "trickle" else _silent)
    backend = _backend(kind, server.port)
    start = time.monotonic()
    try:
        completions = backend.generate_chat_batch(digit_messages(1, 2), PARAMS)
    finally:
        backend.close()
    took = time.monotonic() - start
    assert TIMEOUT_S - 0.1 <= took < TIMEOUT_S + SLACK_S, took
    for completion in completions:
        assert completion.finish_reason == "error"
        assert completion.error == (
            f"no answer within timeout_s={TIMEOUT_S:g} s, the deadline of the whole call (1 "
            "attempt; last: none finished)"
        )


def test_the_wait_is_the_policy_s_longest_at_most() -> None:
    policy = RetryPolicy(initial_backoff_s=0.5, multiplier=2.0, max_backoff_s=3.0, jitter=0.0)
    assert [policy.delay(0, after) for after in (2.0, 7.0, float("inf"), -1.0)] == [
        2.0,
        3.0,
        3.0,
        0.0,
    ]
    assert policy.delay(2, float("nan")) == 2.0  # no wait named: the computed backoff
