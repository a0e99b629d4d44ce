"""Child processes that die with this one, whichever thread starts them.

Linux's parent-death signal (``PR_SET_PDEATHSIG``) is sent when the *thread* that forked the
child ends, not the process: a server started from a ``ThreadPoolExecutor`` worker, or from a
thread per server so that several start at once, would be signalled as soon as that thread
finished. :func:`popen_tied` therefore forks from the main thread when called there, and from
one starter thread kept for the process's life otherwise.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["popen_tied"]

_PR_SET_PDEATHSIG = 1


def popen_tied(
    args: Sequence[str],
    *,
    death_signal: signal.Signals = signal.SIGTERM,
    in_child: Callable[[], object] | None = None,
    **popen_kwargs: Any,
) -> subprocess.Popen[Any]:
    """``subprocess.Popen(args, **popen_kwargs)`` whose child gets ``death_signal`` when this
    process dies (on Linux; elsewhere a plain ``Popen``), even by ``SIGKILL``.

    Args:
        args: The command.
        death_signal: What the child receives when this process dies.
        in_child: Also run in the child before ``exec`` (after the signal is set).
        popen_kwargs: Passed on to ``Popen`` (not ``preexec_fn``: use ``in_child``).
    """
    parent = os.getpid()

    def before_exec() -> None:
        if _LIBC is not None:
            _LIBC.prctl(_PR_SET_PDEATHSIG, int(death_signal))
            if os.getppid() != parent:  # this process died between fork and prctl
                os._exit(1)
        if in_child is not None:
            in_child()

    def start() -> subprocess.Popen[Any]:
        return subprocess.Popen(args, preexec_fn=before_exec, **popen_kwargs)

    if threading.current_thread() is threading.main_thread():
        return start()
    return _STARTER.submit(start).result()


def _new_starter() -> None:
    """A fresh starter (also after a fork: the old one's thread was not copied)."""
    global _STARTER
    _STARTER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="child-starter")


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_STARTER: concurrent.futures.ThreadPoolExecutor
_new_starter()
os.register_at_fork(after_in_child=_new_starter)
