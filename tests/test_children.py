"""Children tied to this process live as long as it does, whichever thread started them, and
no longer: a parent killed by SIGKILL takes them with it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agile_llmenvs._children import popen_tied

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's"
)


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_child_started_from_a_thread_outlives_the_thread(
    sleepers: list[subprocess.Popen[bytes]],
) -> None:
    def start() -> None:
        sleepers.append(popen_tied(["sleep", "30"]))

    worker = threading.Thread(target=start)
    worker.start()
    worker.join()
    time.sleep(0.5)  # a child tied to the ended thread is signalled at once
    assert sleepers[0].poll() is None


def test_a_child_started_from_the_main_thread_runs(
    sleepers: list[subprocess.Popen[bytes]],
) -> None:
    sleepers.append(popen_tied(["sleep", "30"]))
    time.sleep(0.2)
    assert sleepers[0].poll() is None


def test_a_thread_gets_the_error_of_a_command_that_cannot_start() -> None:
    errors: list[BaseException] = []

    def start() -> None:
        try:
            popen_tied(["/nonexistent/command"])
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=start)
    worker.start()
    worker.join()
    [error] = errors
    assert isinstance(error, FileNotFoundError)
    assert error.filename == "/nonexistent/command"


def test_in_child_runs_in_the_child_before_exec(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    process = popen_tied(
        ["cat", str(marker)],
        in_child=lambda: marker.write_text(str(os.getpid())),
        stdout=subprocess.PIPE,
    )
    out, _ = process.communicate(timeout=10)
    assert out.decode() == str(process.pid)  # written by the child itself, before `cat` ran


PARENT = """
import signal, subprocess, sys, threading
from agile_llmenvs._children import popen_tied

death = signal.Signals[sys.argv[1]]
child = [
    sys.executable,
    "-c",
    "import signal, sys, time\\n"
    "def done(number, frame):\\n"
    "    open(sys.argv[1], 'w').write(signal.Signals(number).name)\\n"
    "    sys.exit(0)\\n"
    "signal.signal(signal.SIGTERM, done)\\n"
    "print('ready', flush=True)\\n"
    "time.sleep(60)\\n",
    sys.argv[2],
]
started = []
worker = threading.Thread(
    target=lambda: started.append(
        popen_tied(child, death_signal=death, stdout=subprocess.PIPE, text=True)
    )
)
worker.start()
worker.join()
ready = started[0].stdout.readline().strip() or "gone"  # gone: the child died at once
print(started[0].pid, ready, flush=True)
threading.Event().wait()
"""


@pytest.mark.parametrize("death", ["SIGTERM", "SIGKILL"])
def test_a_child_dies_with_a_parent_killed_by_sigkill(tmp_path: Path, death: str) -> None:
    seen = tmp_path / "signal"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, death, str(seen)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    try:
        assert parent.stdout is not None
        pid, state = parent.stdout.readline().split()
        assert state == "ready"  # alive after the thread that started it ended
        child_pid = int(pid)
        assert alive(child_pid)
        parent.kill()  # SIGKILL: no handler, no atexit; only the kernel can tell the child
        parent.wait()
        deadline = time.monotonic() + 10
        while alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child_pid)
        if death == "SIGTERM":  # the child's own handler saw the signal asked for
            assert seen.read_text() == "SIGTERM"
        else:
            assert not seen.exists()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
