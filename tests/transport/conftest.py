"""Fixtures for the transport tests: servers in this process and in subprocesses."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from serving import ServedProcess


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
