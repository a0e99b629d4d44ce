"""Sidecar services of an env host: processes started before its env server, stopped with it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from agile_llmenvs._children import popen_tied
from agile_llmenvs.errors import EnvBuildError
from agile_llmenvs.specs import EnvServiceSpec

__all__ = ["ServiceProcess", "start_services", "stop_services"]


class ServiceProcess:
    """One running sidecar: its process group, and a log file of its output.

    The process dies with the host: it is killed when the host process dies (Linux), even by
    ``SIGKILL``, so a killed host never leaves a service behind.

    Args:
        spec: The service to run (its ``command``, ``port`` and ``env_vars``).
        log_dir: Folder for the service's output.
    """

    def __init__(self, spec: EnvServiceSpec, log_dir: Path) -> None:
        assert spec.command is not None  # HostConfig refuses image-only services
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}.log"
        with self.log_path.open("wb") as log:
            try:
                self.process = popen_tied(
                    spec.command,
                    death_signal=signal.SIGKILL,
                    env={**os.environ, **spec.env_vars},
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                raise EnvBuildError(
                    f"env service {spec.name!r}: cannot run {spec.command!r}: {exc}"
                ) from exc

    def wait_ready(self) -> None:
        """Wait until the service accepts connections on its port (if it has one).

        Raises:
            EnvBuildError: the service exited, or did not listen within its
                ``ready_timeout_s``; the message holds the end of its output.
        """
        deadline = time.monotonic() + self.spec.ready_timeout_s
        while True:
            if self.process.poll() is not None:
                raise EnvBuildError(
                    f"env service {self.spec.name!r} exited with code "
                    f"{self.process.returncode} before it was ready:\n{self.output_tail()}"
                )
            if self.spec.port is None or _accepts(self.spec.port):
                return
            if time.monotonic() > deadline:
                raise EnvBuildError(
                    f"env service {self.spec.name!r} did not listen on port {self.spec.port} "
                    f"within its ready_timeout_s={self.spec.ready_timeout_s}:\n"
                    f"{self.output_tail()}"
                )
            time.sleep(0.05)

    def output_tail(self, lines: int = 10) -> str:
        """The last lines the service printed."""
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(errors="replace")
            return "\n".join(text.strip().splitlines()[-lines:])
        return ""

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the service's process group (``SIGKILL`` after ``timeout_s``)."""
        if self.process.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout_s)
                return


def start_services(specs: Sequence[EnvServiceSpec]) -> list[ServiceProcess]:
    """Start every service in order, each ready before the next starts.

    Raises:
        EnvBuildError: a service failed to start; those already started are stopped.
    """
    log_dir = Path(tempfile.mkdtemp(prefix="agile-llmenvs-services-"))
    started: list[ServiceProcess] = []
    try:
        for spec in specs:
            service = ServiceProcess(spec, log_dir)
            started.append(service)
            service.wait_ready()
    except BaseException:
        stop_services(started)
        raise
    return started


def stop_services(services: Sequence[ServiceProcess]) -> None:
    """Stop services in the reverse order of their start."""
    for service in reversed(services):
        service.stop()


def _accepts(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0
