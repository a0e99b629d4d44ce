"""Fixtures for the transport tests: servers in this process and in subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


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


@pytest.fixture
def serve_process() -> Iterator[Callable[..., ServedProcess]]:
    """Start ``agile-llmenvs serve ARGS`` subprocesses; all are killed at the end."""
    started: list[ServedProcess] = []

    def start(*args: str) -> ServedProcess:
        served = ServedProcess(*args)
        started.append(served)
        return served

    yield start
    for served in started:
        if served.proc.poll() is None:
            served.kill()
