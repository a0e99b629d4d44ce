"""What the API backends share: concurrent requests under a semaphore, with retries.

A batch becomes one coroutine per conversation on the backend's own event loop (a daemon
thread, so the sync API works from scripts, notebooks and running loops alike). At most
``max_concurrency`` requests are in flight. A 429 or 5xx response, or a dropped connection, is
retried with exponential backoff, waiting what a ``Retry-After`` header asks for when there is
one, up to the policy's longest wait. Each call has one deadline, ``timeout_s`` after it
starts: its attempts (connect, send, read) and the waits between them together, so a server
that trickles its reply, never answers, or asks to be retried in a day still ends the call in
time. A request failing past its retries or its deadline becomes a failed :class:`Completion`
(a value, so one bad request does not sink the batch); any other error response (a bad key,
an unknown model) is a configuration problem and raises
:class:`~agile_llmenvs.errors.BackendError`.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import os
import random
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agile_llmenvs._loops import new_event_loop
from agile_llmenvs.backends.types import Completion, Messages, SamplingParams, Tools
from agile_llmenvs.errors import BackendError

__all__ = [
    "APIBackend",
    "APIConfig",
    "APIFailure",
    "RetryPolicy",
    "aiohttp_client",
    "error_message",
    "is_retryable_status",
    "parse_retry_after",
]

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """When and how long to wait before retrying a request.

    Attributes:
        max_retries: Retries after the first attempt; ``0`` never retries.
        initial_backoff_s: The wait before the first retry when the server names none.
        multiplier: Growth of the wait per further retry.
        max_backoff_s: The longest wait, computed or asked for: a ``Retry-After`` above it
            (or not a finite number) waits this long.
        jitter: Random extra wait, as a fraction of the computed wait.
    """

    max_retries: int = 6
    initial_backoff_s: float = 0.5
    multiplier: float = 2.0
    max_backoff_s: float = 30.0
    jitter: float = 0.1

    def delay(self, retry: int, retry_after_s: float | None) -> float:
        """Seconds to wait before retry number ``retry`` (0-based)."""
        if retry_after_s is not None and not math.isnan(retry_after_s):
            return min(self.max_backoff_s, max(0.0, retry_after_s))
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**retry)
        return base * (1.0 + self.jitter * random.random())


@dataclass(frozen=True)
class APIConfig:
    """Settings of an API backend beyond its model, endpoint and concurrency.

    Attributes:
        timeout_s: The longest one call takes: every attempt (connect, send, read) and the
            waits between retries together; past it the call is a failed completion.
        retry: The retry policy.
        default_headers: Extra HTTP headers on every request.
    """

    timeout_s: float = 600.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    default_headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class APIFailure:
    """A foreign SDK error, translated: what status came, and whether to retry."""

    message: str
    status_code: int | None
    retryable: bool
    retry_after_s: float | None = None


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds a response asks the client to wait: ``retry-after-ms`` or ``retry-after``.

    ``retry-after`` may be a number of seconds or an HTTP date.
    """
    lowered = {k.lower(): v for k, v in headers.items()}
    if "retry-after-ms" in lowered:
        try:
            return float(lowered["retry-after-ms"]) / 1000.0
        except ValueError:
            pass
    value = lowered.get("retry-after")
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        when = email.utils.parsedate_to_datetime(value) if value.strip() else None
        return None if when is None else max(0.0, when.timestamp() - time.time())


def error_message(body: object, fallback: str) -> str:
    """The provider's own message inside an error body (``{"error": {"message": ...}}``)."""
    inner = body.get("error", body) if isinstance(body, dict) else None
    if isinstance(inner, dict) and isinstance(inner.get("message"), str):
        return str(inner["message"])
    return fallback


def is_retryable_status(status: int | None) -> bool:
    """429 (rate limited), any 5xx, and no response at all (a dropped connection)."""
    return status is None or status == 429 or status >= 500


def translate_sdk_error(exc: Exception, sdk: Any) -> APIFailure | None:
    """An OpenAI or Anthropic SDK error as an :class:`APIFailure` (None: not the SDK's).

    Both official SDKs raise ``APIStatusError`` (with the response) and
    ``APIConnectionError`` (timeouts included): the first retries on 429 and 5xx, the second
    always.
    """
    if isinstance(exc, sdk.APIStatusError):
        status = exc.status_code
        return APIFailure(
            error_message(exc.body, str(exc.message)),
            status,
            is_retryable_status(status),
            parse_retry_after(exc.response.headers),
        )
    if isinstance(exc, sdk.APIConnectionError):
        return APIFailure(str(exc) or type(exc).__name__, None, True)
    return None


def aiohttp_client(sdk: Any) -> Any:
    """The SDK's aiohttp-based HTTP client when ``aiohttp`` is installed, else ``None``.

    Both official SDKs ship one; it costs about half the CPU per request of their default
    ``httpx`` client, which matters at tens of requests in flight.
    """
    try:
        return sdk.DefaultAioHttpClient()
    except (AttributeError, RuntimeError):  # an old SDK, or the aiohttp extra is missing
        return None


class _LoopThread:
    """An event loop on a daemon thread, started on first use."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        with self._lock:
            if self._loop is None:
                self._loop = new_event_loop()
                self._thread = threading.Thread(
                    target=self._loop.run_forever, name="agile-llmenvs-api", daemon=True
                )
                self._thread.start()
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    def close(self, last: Awaitable[Any] | None = None) -> None:
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return
        if last is not None:
            asyncio.run_coroutine_threadsafe(_await(last), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


async def _await(awaitable: Awaitable[Any]) -> None:
    await awaitable


class APIBackend(ABC):
    """A chat backend over an HTTP API, built on its official async SDK.

    Subclasses build the SDK client, send one request, and translate the SDK's errors.

    Args:
        model: The provider's model name.
        base_url: The API's base URL; ``None`` uses the SDK's (or the provider's) default.
        api_key: The key; ``None`` reads the provider's usual environment variable.
        max_concurrency: Most requests in flight at once.
        config: Timeout, retry policy and headers.
    """

    #: The environment variable holding the provider's key.
    api_key_env = ""

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        max_concurrency: int = 64,
        config: APIConfig | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.model = model
        self.base_url = base_url
        self.max_concurrency = max_concurrency
        self.config = config or APIConfig()
        self._api_key = self._resolve_api_key(api_key)
        self._loop = _LoopThread()
        self._semaphore: asyncio.Semaphore | None = None
        self._client: Any = None  # the SDK client, built on the loop that uses it

    def _resolve_api_key(self, api_key: str | None) -> str:
        key = api_key or os.environ.get(self.api_key_env)
        if key:
            return key
        if self.base_url is not None:  # a self-hosted server rarely checks keys
            return "not-needed"
        raise BackendError(
            f"{type(self).__name__} needs an API key: pass api_key=... or set {self.api_key_env}."
        )

    @abstractmethod
    def _make_client(self) -> Any:
        """The SDK's async client, with its own retries off (this class retries)."""

    @abstractmethod
    async def _request(
        self, messages: Messages, tools: Tools | None, params: SamplingParams
    ) -> Completion:
        """Send one request and read its completion; SDK errors propagate."""

    @abstractmethod
    def _translate(self, exc: Exception) -> APIFailure | None:
        """The SDK error ``exc`` as an :class:`APIFailure`; ``None`` if it is not one."""

    def generate_chat(self, messages: Messages, params: SamplingParams) -> Completion:
        """Generate one completion for one conversation."""
        return self.generate_chat_batch([messages], params)[0]

    def generate_chat_batch(
        self, batch: Sequence[Messages], params: SamplingParams
    ) -> list[Completion]:
        """Generate one completion per conversation, as concurrent requests."""
        return self._loop.run(self._gather(batch, None, params))

    def generate_with_tools_batch(
        self, batch: Sequence[Messages], tools: Tools, params: SamplingParams
    ) -> list[Completion]:
        """As :meth:`generate_chat_batch`, offering ``tools`` to the model."""
        return self._loop.run(self._gather(batch, list(tools), params))

    def close(self) -> None:
        """Close the HTTP client and stop the backend's event loop."""
        client, self._client = self._client, None
        self._loop.close(client.close() if client is not None else None)

    async def _gather(
        self, batch: Sequence[Messages], tools: Tools | None, params: SamplingParams
    ) -> list[Completion]:
        if self._client is None:  # both bind to the loop that first uses them
            self._client = self._make_client()
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        tasks = [asyncio.ensure_future(self._with_retries(m, tools, params)) for m in batch]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _with_retries(
        self, messages: Messages, tools: Tools | None, params: SamplingParams
    ) -> Completion:
        assert self._semaphore is not None
        policy, loop = self.config.retry, asyncio.get_running_loop()
        deadline: float | None = None  # timeout_s after the first attempt starts
        last = "none finished"
        for retry in range(policy.max_retries + 1):
            async with self._semaphore:
                if deadline is None:
                    deadline = loop.time() + self.config.timeout_s
                try:
                    return await asyncio.wait_for(
                        self._request(messages, tools, params), deadline - loop.time()
                    )
                except TimeoutError:
                    if loop.time() < deadline:  # not the deadline's: a client's own error
                        raise
                    return self._past_deadline(retry + 1, last)
                except Exception as exc:
                    failure = self._translate(exc)
                    if failure is None:
                        raise
                    if not failure.retryable:
                        raise BackendError(
                            f"{type(self).__name__} request for model {self.model!r} was "
                            f"refused (HTTP {failure.status_code}): {failure.message}",
                            status_code=failure.status_code,
                        ) from exc
            last = f"HTTP {failure.status_code}: {failure.message}"
            if retry == policy.max_retries:
                return Completion.failed(f"gave up after {retry + 1} attempts; last: {last}")
            wait = policy.delay(retry, failure.retry_after_s)
            if loop.time() + wait >= deadline:  # the retry could not start in time
                return self._past_deadline(retry + 1, f"{last}; the next retry after {wait:g} s")
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover

    def _past_deadline(self, attempts: int, last: str) -> Completion:
        return Completion.failed(
            f"no answer within timeout_s={self.config.timeout_s:g} s, the deadline of the whole "
            f"call ({attempts} attempt{'s' if attempts > 1 else ''}; last: {last})"
        )
