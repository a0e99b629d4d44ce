"""The limits ``agile-llmenvs serve`` puts on slow clients, for the ASGI app under uvicorn.

uvicorn closes an idle keep-alive connection (``--timeout-keep-alive``) and, with
``--limit-concurrency``, answers 503 past a number of connections, but it sets no deadline on
a client's *request*: one that sends its headers or its body a byte at a time (slowloris)
holds its connection for as long as it keeps sending, and so do thousands of them.
``agile-llmenvs serve`` closes a connection whose request does not arrive within 10 s (the
handshake deadline of its ``websockets`` server).

:class:`GuardedH11Protocol` is uvicorn's own h11 protocol with that deadline: from a
connection's start, and from the end of each response on a kept-alive one, the client's next
request (headers and body) must arrive within :attr:`~GuardedH11Protocol.request_timeout_s`
(10 s; ``$AGILE_LLMENVS_REQUEST_TIMEOUT_S`` sets it), or the connection is closed. The
deadline stops once the request is in: an env call may take as long as the server's own
timeouts allow, and a WebSocket session is the session code's (``first_message_timeout_s``,
idle reaping). It also keeps a ``?token=...`` out of uvicorn's access log
(:class:`RedactTokens`: the value is written ``***``), where a URL's query string would
otherwise put the server's secret. Serve with::

    uvicorn module:app --http agile_llmenvs.transport.uvicorn_limits:GuardedH11Protocol \\
        --limit-concurrency 1024 --timeout-keep-alive 5

or from Python, :func:`serve_asgi` (the same settings).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = [
    "DEFAULT_LIMIT_CONCURRENCY",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "GuardedH11Protocol",
    "RedactTokens",
    "guarded_uvicorn_settings",
    "serve_asgi",
]

#: Seconds a client has to send a request, headers and body (``agile-llmenvs serve``'s).
DEFAULT_REQUEST_TIMEOUT_S = 10.0
#: Connections (and requests in flight) past which uvicorn answers 503.
DEFAULT_LIMIT_CONCURRENCY = 1024
#: What h11 says of a client whose request is fully in (or that left HTTP).
_REQUEST_IN = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.SWITCHED_PROTOCOL, h11.ERROR)


_TOKEN_IN_QUERY = re.compile(r"([?&]token=)[^&\s\"]*")


class RedactTokens(logging.Filter):
    """A logging filter that writes ``token=***`` for the value of every ``token=`` in a
    URL's query string of a record's message and arguments."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                _TOKEN_IN_QUERY.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args
            )
        if isinstance(record.msg, str):
            record.msg = _TOKEN_IN_QUERY.sub(r"\1***", record.msg)
        return True


def _redact_access_log() -> None:
    """Put :class:`RedactTokens` on uvicorn's access log (once)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactTokens) for f in access.filters):
        access.addFilter(RedactTokens())


def _request_timeout_s() -> float:
    raw = os.environ.get("AGILE_LLMENVS_REQUEST_TIMEOUT_S")
    if raw is None:
        return DEFAULT_REQUEST_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(
            f"AGILE_LLMENVS_REQUEST_TIMEOUT_S must be a number of seconds above 0, got {raw!r}"
        )
    return value


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline on each request's arrival (see the module)."""

    #: Seconds a client has to send a request; read from the environment when the class is
    #: imported (subclass to set it in code).
    request_timeout_s: float = _request_timeout_s()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        _redact_access_log()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._check()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on a kept-alive connection
            self._check()  # a pipelined one may be in already

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.request_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _check(self) -> None:
        upgraded = self.transport.get_protocol() is not self
        if upgraded or self.conn.their_state in _REQUEST_IN:
            self._disarm()

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def guarded_uvicorn_settings(
    *,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY,
    timeout_keep_alive: int = 5,
) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` / ``uvicorn.run`` that give the ASGI app
    ``agile-llmenvs serve``'s limits on slow and idle clients.

    Raises:
        ValueError: ``request_timeout_s`` is not above 0, or ``limit_concurrency`` below 1.
    """
    if not request_timeout_s > 0:
        raise ValueError(f"request_timeout_s must be above 0, got {request_timeout_s}")
    if limit_concurrency is not None and limit_concurrency < 1:
        raise ValueError(f"limit_concurrency must be at least 1, got {limit_concurrency}")
    protocol = type(
        "GuardedH11Protocol", (GuardedH11Protocol,), {"request_timeout_s": request_timeout_s}
    )
    return {
        "http": protocol,
        "limit_concurrency": limit_concurrency,
        "timeout_keep_alive": timeout_keep_alive,
    }


def serve_asgi(app: Any, *, host: str = "127.0.0.1", port: int = 8000, **limits: Any) -> None:
    """Serve ``app`` (:func:`~agile_llmenvs.transport.create_asgi_app`'s, say) with uvicorn
    and :func:`guarded_uvicorn_settings` (``limits`` are its keywords), until interrupted."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, **guarded_uvicorn_settings(**limits))
