"""Servers for tests: ``agile-llmenvs serve`` in a subprocess (for tests that need a server
they can kill), and an ASGI app such as OpenEnv's ``create_app`` under uvicorn in a thread."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent


def wait_until(
    condition: Callable[[], bool], timeout_s: float = 10.0, failure: str = "timed out waiting"
) -> None:
    """Poll ``condition`` every 10 ms until it holds; fail with ``failure`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.01)


class ServedProcess:
    """``agile-llmenvs serve`` running in a subprocess."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agile_llmenvs", "serve", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("serving "):
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r} {self.proc.stderr.read()!r}")
        self.url = line.split(" at ", 1)[1].split(" ", 1)[0]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


class UvicornApp:
    """An ASGI app (OpenEnv's own ``create_app``, or ours) served by uvicorn on 127.0.0.1, in
    a daemon thread, with ``uvicorn.Config`` ``settings``; a context manager that stops it on
    exit."""

    def __init__(self, app: Any, **settings: Any) -> None:
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **settings))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            self.close()
            raise RuntimeError(f"uvicorn did not start serving {self.url} within 30 s")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def __enter__(self) -> UvicornApp:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
