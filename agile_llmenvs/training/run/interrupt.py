"""SIGINT / SIGTERM during training: finish the step, save a checkpoint, stop cleanly.

The first signal only sets a flag that the loop reads after each step (every process agrees
on it, so all save and stop together); a second one is handled as the signal normally is,
so a run that will not stop can still be ended.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

import torch

__all__ = ["StopRequest"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """A context in which SIGINT and SIGTERM ask the loop to stop after its current step.

    Off the main thread (where Python cannot install handlers) it never fires.

    Attributes:
        signal_name: The name of the first signal received (``None`` until one arrives).
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for number in _SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _handle(self, number: int, frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(number).name
        signal.signal(number, self._previous.get(number, signal.SIG_DFL))  # the second one acts

    def requested(self, accelerator: Any) -> bool:
        """Whether any process received a signal (every process gets the same answer)."""
        asked = self.signal_name is not None
        if accelerator.num_processes == 1:
            return asked
        flag = torch.tensor([float(asked)], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)
