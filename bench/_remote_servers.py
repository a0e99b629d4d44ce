"""Servers for bench/remote_env.py and bench/slow_clients.py, each run in its own process:
``python _remote_servers.py KIND`` (``floor``, ``openenv``, ``ours``, ``asgi``,
``asgi_guarded``).

Prints the port on stdout once listening, then serves until killed.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from typing import Any

PAYLOAD = "x" * 200  # with the JSON framing, frames are about 300 bytes


class BenchEnv:
    """A text env whose step costs nothing: what is measured is the transport."""

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        self.turn = 0
        return PAYLOAD, {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        return action, 1.0, False, False, {}

    def close(self) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _echo(port: int) -> None:
    from websockets.asyncio.server import serve

    async def handler(ws: Any) -> None:
        async for message in ws:
            await ws.send(message)

    async with serve(handler, "127.0.0.1", port, compression=None):
        print(port, flush=True)
        await asyncio.Future()


def _openenv(port: int) -> None:
    import uvicorn
    from openenv.core.env_server.http_server import create_app

    from agile_llmenvs.transport import OpenEnvWrapper, TextAction, TextObservation

    app = create_app(
        lambda: OpenEnvWrapper(BenchEnv(), owns_inner=True),
        TextAction,
        TextObservation,
        max_concurrent_envs=256,
    )
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", ws_per_message_deflate=False
    )
    server = uvicorn.Server(config)
    print(port, flush=True)
    server.run()


def _ours(port: int) -> None:
    from agile_llmenvs.transport import OpenEnvServer

    OpenEnvServer(make_env=BenchEnv, port=port, max_concurrent_envs=256)
    print(port, flush=True)
    while True:
        time.sleep(3600)


def _asgi(port: int, *, guarded: bool) -> None:
    """Our ASGI app under uvicorn: plain, or with ``agile-llmenvs serve``'s request deadline
    and connection cap (:mod:`agile_llmenvs.transport.uvicorn_limits`)."""
    import uvicorn

    from agile_llmenvs.transport import create_asgi_app
    from agile_llmenvs.transport.uvicorn_limits import guarded_uvicorn_settings

    app = create_asgi_app(make_env=BenchEnv, max_concurrent_envs=256)
    limits = guarded_uvicorn_settings() if guarded else {}
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **limits)
    server = uvicorn.Server(config)
    print(port, flush=True)
    server.run()


if __name__ == "__main__":
    kind, port = sys.argv[1], _free_port()
    if kind == "floor":
        from agile_llmenvs._loops import new_event_loop

        with asyncio.Runner(loop_factory=new_event_loop) as runner:  # uvloop, as ours uses
            runner.run(_echo(port))
    elif kind == "openenv":
        _openenv(port)
    elif kind in ("asgi", "asgi_guarded"):
        _asgi(port, guarded=kind == "asgi_guarded")
    else:
        _ours(port)
