"""Run ``agile-llmenvs serve`` in a subprocess, for tests that need a server they can kill."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


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
