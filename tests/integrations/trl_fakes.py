"""Fakes for the TRL adapter's tests (importable as ``integrations.trl_fakes``): an env that
records when its calls ran, and a scripted policy."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

CALLS: list[tuple[str, int, float, float]] = []
"""Every :class:`TimedEnv` call of this process: ``(call, turn after it, start, end)``."""
_LOCK = threading.Lock()


class TimedEnv:
    """A dataset env of ``rows`` rows, ``turns`` turns an episode, whose reset and step each
    sleep ``delay_s`` and record when they ran in :data:`CALLS`.

    Row ``r`` asks for its number; each turn pays 1.0 when the action is it.
    """

    def __init__(self, rows: int = 2, turns: int = 2, delay_s: float = 0.0) -> None:
        self.dataset_size = rows
        self.turns = turns
        self.delay_s = delay_s
        self.row = -1
        self.turn = 0

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        with self._timed("reset"):
            self.row, self.turn = int(task.get("row_index", 0)), 0
        return f"Say {self.row}.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        with self._timed("step"):
            self.turn += 1
        reward = 1.0 if action.strip() == str(self.row) else 0.0
        return f"Again: say {self.row}.", reward, self.turn >= self.turns, False, {}

    def close(self) -> None:
        pass

    @contextmanager
    def _timed(self, call: str) -> Iterator[None]:
        start = time.monotonic()
        time.sleep(self.delay_s)
        yield
        with _LOCK:
            CALLS.append((call, self.turn, start, time.monotonic()))


Policy = Callable[[list[list[int]]], list[tuple[tuple[int, ...], tuple[float, ...]]]]


def scripted(tokenizer: Any, *replies: str) -> Policy:
    """A policy that answers the k-th generate call with ``replies[k]`` (the last one from then
    on), then end-of-turn, log-prob -0.5 per id. A reply ``"a|b"`` answers the call's first
    context ``a`` and the others ``b``."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    calls = iter(replies)
    reply = replies[0]

    def generate(contexts: list[list[int]]) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
        nonlocal reply
        reply = next(calls, reply)
        texts = reply.split("|")
        out = []
        for i in range(len(contexts)):
            ids = (*tokenizer.encode(texts[min(i, len(texts) - 1)], add_special_tokens=False), end)
            out.append((ids, (-0.5,) * len(ids)))
        return out

    return generate
