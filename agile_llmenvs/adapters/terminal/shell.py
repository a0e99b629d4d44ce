"""A persistent ``bash`` behind pipes: one command at a time, each bounded by a timeout.

Each command is handed to the shell as one ``eval`` of a quoted string, with its standard
input from ``/dev/null`` (a command that reads the terminal gets end-of-file instead of
swallowing the next command), followed by a ``printf`` of a marker unique to the shell and
the command's exit status. Output and errors share one pipe and are read up to that marker.
So the shell keeps its state between commands (working directory, variables, functions), a
syntax error is just a failed command, and nothing the command prints can end it early.

A command that would leave an interactive shell at its continuation prompt (``>``: an unclosed
quote, a heredoc without its terminator, a trailing ``|`` or ``\\``) is found by
:func:`is_incomplete` before it is sent, and is not run. A command that outlives its timeout,
or a shell that exits (``exit 3``), costs the shell: its whole process group is killed and a
fresh shell starts in the same directory, so files survive and shell variables do not.

Given a :class:`~agile_llmenvs.adapters.terminal.jail.JailSpec`, the shell runs in a
bubblewrap jail: its own PID namespace, killed whole (``setsid`` children included) when the
shell is restarted or closed. A command that redirects the shell's own output away (``exec
>/dev/null``) never prints its marker: it times out, and the shell restarts.
"""

from __future__ import annotations

import contextlib
import os
import select
import shlex
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from agile_llmenvs.adapters.terminal.jail import Jailed, JailSpec, start_jailed
from agile_llmenvs.errors import EnvBuildError

__all__ = ["CommandResult", "ShellSession", "is_incomplete"]

_INCOMPLETE_SIGNS = ("unexpected EOF", "unexpected end of file", "delimited by end-of-file")
_READ_SIZE = 65536
_POLL_S = 0.2
_START_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class CommandResult:
    """What running one command gave.

    Attributes:
        output: Everything the command wrote (standard output and error, interleaved).
        exit_code: The command's exit status; ``None`` when it timed out or was not run.
        elapsed_s: Wall-clock seconds the command ran.
        timed_out: The command outlived its timeout and was killed with its shell.
        shell_restarted: The shell was replaced by a fresh one (after a timeout or an exit).
        incomplete: The command was not run: the shell would have waited for more input.
    """

    output: str
    exit_code: int | None
    elapsed_s: float = 0.0
    timed_out: bool = False
    shell_restarted: bool = False
    incomplete: bool = False


def is_incomplete(command: str) -> bool:
    """Whether ``command``, typed into an interactive shell, would end at a continuation prompt.

    ``bash -n`` parses the command without running it; running out of input inside a quote,
    a compound command or a heredoc is what leaves a terminal at ``>``. A last line ending in
    an unescaped backslash does too (the newline that sends it is then a line continuation).
    """
    last_line = command.rstrip("\n").rsplit("\n", 1)[-1]
    if (len(last_line) - len(last_line.rstrip("\\"))) % 2 == 1:
        return True
    checked = subprocess.run(
        ["bash", "--noprofile", "--norc", "-n"],
        input=command + "\n",
        capture_output=True,
        text=True,
        env={"LC_ALL": "C", "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        timeout=30,
        check=False,
    )
    return any(sign in checked.stderr for sign in _INCOMPLETE_SIGNS)


class ShellSession:
    """One persistent ``bash --noprofile --norc`` process group, working in ``cwd``.

    Args:
        cwd: The directory the shell starts in (and restarts in).
        env: The shell's environment variables (the whole environment, not additions).
        jail: Run the shell in this bubblewrap jail (``None``: unsandboxed, as this user).
    """

    def __init__(self, cwd: Path, env: Mapping[str, str], *, jail: JailSpec | None = None) -> None:
        self.cwd = cwd
        self._env = dict(env)
        self._jail = jail
        self._jailed: Jailed | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._marker = f"__agile_llmenvs_done_{uuid.uuid4().hex}__".encode()
        self._start()

    @property
    def pid(self) -> int | None:
        """The running shell's process id (also its process group id); ``None`` once closed."""
        return self._process.pid if self._process is not None else None

    def run(self, command: str, timeout_s: float) -> CommandResult:
        """Run ``command`` in the shell and wait at most ``timeout_s`` seconds for it.

        The caller checks :func:`is_incomplete` first: an incomplete command sent here fails
        with a syntax error instead of waiting for input.
        """
        process = self._require_process()
        script = f"eval {shlex.quote(command.replace(chr(0), ''))} </dev/null\n"
        script += f"printf '%s%d\\n' '{self._marker.decode()}' \"$?\"\n"
        started = time.monotonic()
        try:
            assert process.stdin is not None
            process.stdin.write(script.encode())
            process.stdin.flush()
        except BrokenPipeError:  # the shell died between commands (killed from outside)
            pass
        data, status, ended = self._read_until_marker(process, started + timeout_s)
        elapsed = time.monotonic() - started
        output = data.decode("utf-8", errors="replace")
        if status is not None:
            return CommandResult(output, status, elapsed)
        exit_code = process.poll() if ended else None
        self._restart()
        return CommandResult(output, exit_code, elapsed, timed_out=not ended, shell_restarted=True)

    @property
    def jailed(self) -> Jailed | None:
        """The running shell's jail, when it has one."""
        return self._jailed

    def close(self) -> None:
        """Kill the shell and everything it started (its PID namespace, or process group)."""
        process, self._process = self._process, None
        jailed, self._jailed = self._jailed, None
        if process is None:
            return
        if jailed is not None:
            jailed.kill()
        else:
            _kill_group(process)
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()

    def _start(self) -> None:
        if self._jail is not None:
            self._jailed = start_jailed(self._jail, ["bash", "--noprofile", "--norc"])
            self._process = self._jailed.process
            self._await_ready()
            return
        try:
            self._process = subprocess.Popen(
                ["bash", "--noprofile", "--norc"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=self.cwd,
                env=self._env,
                start_new_session=True,  # its own process group, killed whole
            )
        except OSError as exc:
            raise EnvBuildError(
                f"cannot start bash in {str(self.cwd)!r}: {exc}; the terminal env needs "
                "bash on PATH"
            ) from exc

    def _await_ready(self) -> None:
        """Wait (bounded) until the jailed shell answers, so it is up and not just bwrap."""
        process = self._require_process()
        assert process.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            process.stdin.write(f"printf '%s%d\\n' '{self._marker.decode()}' 0\n".encode())
            process.stdin.flush()
        data, status, _ = self._read_until_marker(process, time.monotonic() + _START_TIMEOUT_S)
        if status != 0:
            self.close()
            raise EnvBuildError(
                f"the sandboxed shell did not start; it printed {data.decode(errors='replace')!r}"
            )

    def _restart(self) -> None:
        self.close()
        self._start()

    def _require_process(self) -> subprocess.Popen[bytes]:
        if self._process is None:
            raise EnvBuildError("the shell session is closed; start a new episode")
        return self._process

    def _read_until_marker(
        self, process: subprocess.Popen[bytes], deadline: float
    ) -> tuple[bytes, int | None, bool]:
        """``(output, status, shell_ended)``: status is ``None`` on a timeout or an exit."""
        assert process.stdout is not None
        fd = process.stdout.fileno()
        buffer = _CappedBuffer()
        while True:
            found = buffer.status_after(self._marker)
            if found is not None:
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return buffer.contents(), None, False
            ready, _, _ = select.select([fd], [], [], min(remaining, _POLL_S))
            chunk = os.read(fd, _READ_SIZE) if ready else b""
            if chunk:
                buffer.append(chunk)
            elif ready or process.poll() is not None:
                # End of file, or the shell exited while a child it left keeps the pipe open.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=2)
                return buffer.contents(), None, True


class _CappedBuffer:
    """A command's output, keeping its first and last ``cap`` bytes when it grows past that."""

    def __init__(self, cap: int = 1 << 20) -> None:
        self.cap = cap
        self.data = bytearray()
        self.cut = 0

    def append(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > 3 * self.cap:
            self.cut += len(self.data) - 2 * self.cap
            self.data = self.data[: self.cap] + self.data[-self.cap :]

    def status_after(self, marker: bytes) -> tuple[bytes, int | None, bool] | None:
        at = self.data.rfind(marker)
        if at < 0:
            return None
        end = self.data.find(b"\n", at)
        if end < 0:
            return None
        status = int(self.data[at + len(marker) : end])
        return self._with_cut(bytes(self.data[:at])), status, False

    def contents(self) -> bytes:
        return self._with_cut(bytes(self.data))

    def _with_cut(self, data: bytes) -> bytes:
        if not self.cut:
            return data
        note = f"\n[... {self.cut} bytes of output dropped ...]\n".encode()
        return data[: self.cap] + note + data[self.cap :]


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)
