"""The package's event loops: uvloop's where installed, asyncio's when asked."""

from __future__ import annotations

import asyncio

import pytest

from agile_llmenvs._loops import new_event_loop


def test_uvloop_is_used_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    uvloop = pytest.importorskip("uvloop")
    monkeypatch.delenv("AGILE_LLMENVS_EVENT_LOOP", raising=False)
    loop = new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_asyncio_loop_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGILE_LLMENVS_EVENT_LOOP", "asyncio")
    loop = new_event_loop()
    try:
        assert isinstance(loop, asyncio.BaseEventLoop)
        assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()
