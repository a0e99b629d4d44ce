"""The servers one :class:`~agile_llmenvs.backends.VLLMServerBackend` talks to: which one
takes the next request, which are down for a while or retired, and the HTTP calls to them.

A call whose server refuses the connection, drops it, answers 5xx or exceeds ``timeout_s``
fails typed (:class:`~agile_llmenvs.errors.GenerationServerError` naming the server), and that
server then gets no requests for :data:`DOWN_FOR_S` (unless every server is down). HTTP goes
through one ``aiohttp`` session, on the event loop thread remote env sessions use
(:data:`~agile_llmenvs.transport.session_loop.SESSION_LOOP`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from agile_llmenvs import _json
from agile_llmenvs.errors import (
    GenerationServerError,
    GenerationTimeoutError,
    OptionalDependencyError,
)

if TYPE_CHECKING:
    import aiohttp

    from agile_llmenvs.transport.session_loop import SessionLoop

__all__ = [
    "DOWN_FOR_S",
    "JSON_ROUTES",
    "Routing",
    "Server",
    "ServerPool",
    "gather_errors",
    "session_loop",
]

Routing = Literal["least_loaded", "round_robin"]
_JSON_BODY = {"Content-Type": "application/json"}
DOWN_FOR_S = 5.0  # how long a failed server gets no requests before it is tried again
#: The routes vLLM answers with JSON: a 200 there with another body (an HTML page from a proxy,
#: say) is a failure of the server, not a success.
JSON_ROUTES = ("/v1/completions", "/collective_rpc")

_T = TypeVar("_T")


@dataclass
class Server:
    """One server's routing state (touched on the session loop only)."""

    url: str
    in_flight: int = 0
    down_until: float = 0.0
    max_lora_rank: int | None = None  # once an adapters sync has asked the server

    def up(self, now: float) -> bool:
        return now >= self.down_until


class ServerPool:
    """The servers that take requests, how requests are spread over them, and the HTTP
    session to them.

    Args:
        urls: Base URL of each server (``http://host:port``).
        routing: ``least_loaded`` sends each request to the server with the fewest requests
            in flight (ties in turn), ``round_robin`` to each in turn.
        timeout_s: Most seconds per call.

    Raises:
        OptionalDependencyError: ``aiohttp`` is not installed.
        ValueError: ``urls`` is empty or holds a URL that is not ``http(s)://``, or
            ``routing`` or ``timeout_s`` is invalid.
    """

    def __init__(self, urls: str | Sequence[str], *, routing: Routing, timeout_s: float) -> None:
        try:
            import aiohttp
        except ImportError as exc:
            raise OptionalDependencyError(
                "aiohttp", extra="vllm_server", feature="VLLMServerBackend"
            ) from exc
        self._aiohttp = aiohttp
        #: The servers that take requests, in the order given (retired ones left out).
        self.servers = [Server(url) for url in _check_urls(urls)]
        self.retired: tuple[str, ...] = ()
        if routing not in ("least_loaded", "round_robin"):
            raise ValueError(f"routing must be 'least_loaded' or 'round_robin', got {routing!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.routing: Routing = routing
        self.timeout_s = float(timeout_s)
        self._next = 0  # where the round robin (and least_loaded's ties) resume
        self._session: aiohttp.ClientSession | None = None

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(s.url for s in self.servers)

    def in_flight(self) -> dict[str, int]:
        return {s.url: s.in_flight for s in self.servers}

    def retire(self, urls: Sequence[str]) -> None:
        """Send no more calls to the servers at ``urls``; at least one must be left.

        Raises:
            ValueError: ``urls`` names every server left.
        """
        keep = [s for s in self.servers if s.url not in set(urls)]
        if not keep:
            raise ValueError(f"retiring {list(urls)} would leave no server to generate")
        self.servers = keep
        self.retired += tuple(u for u in urls if u not in self.retired)
        self._next %= len(keep)

    def _pick(self) -> Server:
        now = time.monotonic()
        servers = self.servers
        order = servers[self._next :] + servers[: self._next]
        live = [s for s in order if s.up(now)] or order  # all down: try them anyway
        chosen = live[0] if self.routing == "round_robin" else min(live, key=_load)
        self._next = (servers.index(chosen) + 1) % len(servers)
        return chosen

    def client(self) -> aiohttp.ClientSession:
        """The HTTP session (made on first use).

        Raises:
            RuntimeError: Called elsewhere than on the session loop.
        """
        loop = asyncio.get_running_loop()
        if loop is not session_loop().loop:
            raise RuntimeError(
                "VLLMServerBackend.agenerate must be awaited on SESSION_LOOP.loop "
                "(asyncio.run_coroutine_threadsafe(..., SESSION_LOOP.loop)); blocking callers "
                "use generate()"
            )
        if self._session is None or self._session.closed:
            aiohttp = self._aiohttp
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                connector=aiohttp.TCPConnector(limit=0),  # vllm batches whatever comes
            )
        return self._session

    def mark_down(self, url: str) -> None:
        """Send the server at ``url`` no requests for :data:`DOWN_FOR_S` (its reply was
        wrong)."""
        for server in self.servers:
            if server.url == url:
                server.down_until = time.monotonic() + DOWN_FOR_S

    async def post_routed(self, path: str, body: dict[str, Any]) -> tuple[Any, str]:
        """POST ``body`` to the server routing picks, counted in flight meanwhile; its JSON
        reply and its URL."""
        server = self._pick()
        server.in_flight += 1
        try:
            reply = await self.post(server, path, body)
        finally:
            server.in_flight -= 1
        return reply, server.url

    async def post(self, server: Server, path: str, body: dict[str, Any]) -> Any:
        """POST ``body`` to one server; its JSON reply, or a typed error (and the server
        marked down, unless the request itself was at fault: a 4xx)."""
        session = self.client()
        url = server.url + path
        # a prompt's ids are most of a request: written by msgspec, unwalked (see _json)
        data = _json.dumps_bytes(body, ids="prompt")
        try:
            async with session.post(url, data=data, headers=_JSON_BODY) as response:
                if response.status >= 400:
                    detail = (await response.text())[:500]
                    if response.status >= 500:
                        server.down_until = time.monotonic() + DOWN_FOR_S
                    raise GenerationServerError(
                        f"{url} answered {response.status}: {detail}",
                        url=server.url,
                        status_code=response.status,
                    )
                if response.content_type == "application/json":
                    raw = await response.read()
                    return _json.loads_lenient(raw) if raw.strip() else None  # as aiohttp's
                if path.split("?")[0] in JSON_ROUTES:
                    detail = (await response.text())[:200]
                    raise ValueError(f"a {response.content_type!r} body, not JSON: {detail!r}")
                return None  # vLLM answers some routes with an empty or a text body
        except ValueError as exc:  # what vLLM answers there is JSON: this is no vLLM reply
            server.down_until = time.monotonic() + DOWN_FOR_S
            raise GenerationServerError(
                f"{url} answered {exc} (is it a vLLM server, and is it well?)", url=server.url
            ) from exc
        except TimeoutError as exc:
            server.down_until = time.monotonic() + DOWN_FOR_S
            raise GenerationTimeoutError(
                f"{url} did not answer within timeout_s={self.timeout_s:g} s",
                url=server.url,
            ) from exc
        except self._aiohttp.ClientError as exc:
            server.down_until = time.monotonic() + DOWN_FOR_S
            raise GenerationServerError(
                f"{url} failed: {type(exc).__name__}: {exc} (is the server running?)",
                url=server.url,
            ) from exc

    async def call_all(self, path: str, body: dict[str, Any] | list[dict[str, Any]] | None) -> None:
        """POST to every server at once (a list ``body``: each its own, in server order);
        raises the first failure once all have answered."""
        bodies = body if isinstance(body, list) else [body or {}] * len(self.servers)
        calls = [
            self.post(server, path, each) for server, each in zip(self.servers, bodies, strict=True)
        ]
        for result in await gather_errors(calls):
            if isinstance(result, GenerationServerError):
                raise result

    async def server_info(self, server: Server) -> dict[str, Any]:
        """The server's settings (``GET /server_info``, vLLM's dev mode) as JSON."""
        url = f"{server.url}/server_info?config_format=json"
        try:
            async with self.client().get(url) as response:
                response.raise_for_status()
                info = await response.json()
        except (TimeoutError, self._aiohttp.ClientError) as exc:
            raise GenerationServerError(
                f"{url}: {type(exc).__name__}: {exc}", url=server.url
            ) from exc
        if not isinstance(info, dict):
            raise GenerationServerError(f"{url}: not a JSON object: {info!r}", url=server.url)
        return info

    async def served_model(self) -> str:
        """The served model's name, from the first server that tells it (``GET /v1/models``).

        Raises:
            GenerationServerError: No server told it.
        """
        session = self.client()
        failures: list[GenerationServerError] = []
        for server in self.servers:
            try:
                async with session.get(server.url + "/v1/models") as response:
                    response.raise_for_status()
                    listing = await response.json()
                return str(listing["data"][0]["id"])
            except (TimeoutError, self._aiohttp.ClientError, KeyError, IndexError) as exc:
                failures.append(
                    GenerationServerError(f"{type(exc).__name__}: {exc}", url=server.url)
                )
        raise GenerationServerError(
            "no server told its model name (GET /v1/models): "
            + "; ".join(f"{e.url}: {e}" for e in failures)
            + "; pass model= to skip the question",
            url=self.servers[0].url,
        )

    def close(self) -> None:
        """Close the HTTP session (a later call opens a fresh one)."""
        if self._session is not None and not self._session.closed:
            session_loop().run(self._session.close())
        self._session = None


def session_loop() -> SessionLoop:
    # imported here: the transport package is heavy, and most backend users never need it
    from agile_llmenvs.transport.session_loop import SESSION_LOOP

    return SESSION_LOOP


async def gather_errors(
    calls: Sequence[Awaitable[_T]],
) -> list[_T | GenerationServerError]:
    """Await all ``calls`` at once; a ``GenerationServerError`` is returned in its place,
    anything else raised."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, GenerationServerError):
            raise result
    return list(results)  # type: ignore[arg-type]


def _load(server: Server) -> int:
    return server.in_flight


def _check_urls(urls: str | Sequence[str]) -> list[str]:
    listed = [urls] if isinstance(urls, str) else list(urls)
    if not listed:
        raise ValueError("urls must name at least one server, got an empty list")
    for url in listed:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(
                f"urls: {url!r} is not an http(s) URL; give each server as http://host:port"
            )
    return [url.rstrip("/") for url in listed]
