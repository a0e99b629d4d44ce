"""Plain HTTP requests on the env server's port, beside its WebSocket sessions.

The ``websockets`` server reads only ``GET`` requests (the WebSocket handshake; ``GET
/health`` and the like are answered from its ``process_request`` hook). OpenEnv's
``create_app`` also serves ``POST /reset``, ``POST /step`` and ``POST /mcp``. A
:class:`RoutingConnection` looks at each connection's request line: a ``GET`` goes on to
``websockets`` untouched (the WebSocket path costs nothing extra), any other method is read
whole (head and ``Content-Length`` body), answered by the server's HTTP handler and closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import ServerConnection

__all__ = [
    "SERVER_ERROR",
    "HttpGate",
    "HttpRequest",
    "HttpResponse",
    "RoutingConnection",
    "routing_connection",
]

logger = logging.getLogger(__name__)

_MAX_HEAD_BYTES = 64 * 1024
_LINGER_S = 2.0  # how long a refused request's unread body is drained before closing


@dataclass(frozen=True)
class HttpRequest:
    """One plain HTTP request: method, path, query, lower-cased headers and body."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True)
class HttpResponse:
    """A response: status and a JSON body (or, with ``text``, a plain-text one)."""

    status: int
    body: Any = field(default=None)
    text: bool = False

    @property
    def content_type(self) -> str:
        """The body's media type."""
        return "text/plain; charset=utf-8" if self.text else "application/json"

    def payload(self) -> bytes:
        """The body as bytes."""
        return str(self.body).encode() if self.text else json.dumps(self.body).encode()

    def encode(self) -> bytes:
        """The response as bytes on the wire (``Connection: close``)."""
        payload = self.payload()
        phrase = HTTPStatus(self.status).phrase
        head = (
            f"HTTP/1.1 {self.status} {phrase}\r\n"
            f"content-type: {self.content_type}\r\n"
            f"content-length: {len(payload)}\r\n"
            "connection: close\r\n\r\n"
        )
        return head.encode() + payload


#: What a failing handler answers: uvicorn's own 500 (plain text).
SERVER_ERROR = HttpResponse(500, "Internal Server Error", text=True)

HttpHandler = Callable[[HttpRequest], Awaitable[HttpResponse]]
HttpGate = Callable[[str, dict[str, str], dict[str, list[str]]], "HttpResponse | None"]
"""Sees a request's path, lower-cased headers and query before its body; a reply refuses it."""


class _Detached:
    """The transport websockets keeps once a connection has become plain HTTP: its last
    act (aborting a connection whose handshake never came) must not cut our reply."""

    def abort(self) -> None: ...

    def close(self) -> None: ...

    def is_closing(self) -> bool:
        return True

    def write(self, data: bytes) -> None: ...

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class RoutingConnection(ServerConnection):
    """A ``websockets`` server connection that answers non-``GET`` requests itself.

    Subclassed per server by :func:`routing_connection`, which sets :attr:`answer` and
    :attr:`max_body_bytes`.
    """

    answer: HttpHandler
    max_body_bytes: int
    gate: HttpGate | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._route: str | None = None  # None until the request line is in; "ws" | "http"
        self._buffer = b""
        self._continued = False

    def data_received(self, data: bytes) -> None:
        if self._route == "ws":
            super().data_received(data)
            return
        if self._route == "done":
            return
        self._buffer += data
        if self._route is None:
            head_end = self._buffer.find(b"\r\n\r\n")
            if head_end < 0 and len(self._buffer) < _MAX_HEAD_BYTES:
                return
            if head_end < 0 or _is_plain_get(self._buffer[:head_end]):
                self._route = "ws"  # a handshake, or a GET websockets answers itself
                data, self._buffer = self._buffer, b""
                super().data_received(data)
                return
            self._route = "http"
        request = self._complete_request()
        if request is None:
            return
        self._route = "done"
        transport = self.transport
        transport.pause_reading()
        # websockets' handshake ends as if the peer had left; the socket is ours from here
        self.transport = _Detached()  # type: ignore[assignment]
        super().connection_lost(None)
        asyncio.get_running_loop().create_task(self._reply(transport, request))

    def connection_lost(self, exc: Exception | None) -> None:
        if self._route != "done":
            super().connection_lost(exc)

    def _complete_request(self) -> HttpRequest | HttpResponse | None:
        """The request once head and body are in (None until then), or the error reply."""
        head_end = self._buffer.find(b"\r\n\r\n")
        if head_end < 0:
            if len(self._buffer) > _MAX_HEAD_BYTES:
                return HttpResponse(431, {"detail": "Request header fields too large"})
            return None
        lines = self._buffer[:head_end].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return HttpResponse(400, {"detail": "Bad request line"})
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                return HttpResponse(400, {"detail": "Bad header line"})
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return HttpResponse(411, {"detail": "Send the body with a Content-Length"})
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            return HttpResponse(400, {"detail": "Bad Content-Length"})
        target = urlsplit(parts[1])
        query = parse_qs(target.query)
        refused = self.gate(target.path, headers, query) if self.gate is not None else None
        if refused is not None:  # at the headers: the body is never read, let alone held
            return refused
        if length > self.max_body_bytes:
            return HttpResponse(
                413, {"detail": f"Body of {length} bytes exceeds {self.max_body_bytes}"}
            )
        body = self._buffer[head_end + 4 :]
        if len(body) < length:
            if headers.get("expect", "").lower() == "100-continue" and not self._continued:
                self._continued = True  # curl waits for this before it sends a large body
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            return None
        return HttpRequest(parts[0], target.path, query, headers, body[:length])

    async def _reply(
        self, transport: asyncio.Transport, request: HttpRequest | HttpResponse
    ) -> None:
        try:
            response = request if isinstance(request, HttpResponse) else await self.answer(request)
        except Exception:
            logger.exception("the env server's HTTP handler failed")
            response = SERVER_ERROR
        if transport.is_closing():
            return
        transport.write(response.encode())
        if isinstance(request, HttpResponse) and transport.can_write_eof():
            # refused before its body was read: half-close and drop what the peer still
            # sends, so that it reads this reply instead of a reset connection
            transport.write_eof()
            transport.resume_reading()
            asyncio.get_running_loop().call_later(_LINGER_S, transport.close)
        else:
            transport.close()


def _is_plain_get(head: bytes) -> bool:
    """Whether a request head is a ``GET`` without a body (what ``websockets`` reads)."""
    if not head.startswith(b"GET "):
        return False
    lowered = head.lower()
    return b"\ncontent-length:" not in lowered and b"\ntransfer-encoding:" not in lowered


def routing_connection(
    answer: HttpHandler, max_body_bytes: int, gate: HttpGate | None = None
) -> type[ServerConnection]:
    """A :class:`RoutingConnection` class whose plain HTTP requests go to ``answer``;
    ``gate`` sees each request's path, headers and query once its head is in, and refuses it
    there (before its body is read) by returning the reply."""
    return type(
        "EnvServerConnection",
        (RoutingConnection,),
        {
            "answer": staticmethod(answer),
            "max_body_bytes": max_body_bytes,
            "gate": staticmethod(gate) if gate is not None else None,
        },
    )
