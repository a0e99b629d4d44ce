"""A bubblewrap jail for one process tree: namespaces, a narrow filesystem view and rlimits.

:func:`start_jailed` starts a command under ``bwrap`` in new PID, mount, IPC, UTS, cgroup and
(unless the task allows it) network namespaces, with a fresh ``/proc``, a minimal ``/dev``, a
size-bounded private ``/tmp``, the system folders bound read-only, only the folders a
:class:`JailSpec` names bound in, an environment of its own (``--clearenv``) and rlimits set
by ``prlimit`` on processes, file size, address space, CPU time and open files. Run as root,
bwrap sets up the namespaces and ``setpriv`` drops to an unprivileged uid of the jail's own
(so the process limit is counted for that uid only, and is enforced); run as another user,
bwrap makes a user namespace and the processes keep that user.

:class:`Jailed` ends the whole tree at once: killing the PID namespace's init (whose host pid
bwrap reports on ``--info-fd``) makes the kernel kill every process in the namespace,
``setsid`` or not, and :meth:`Jailed.kill` waits until ``/proc`` shows none left. Every read
and wait here is bounded by a deadline.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agile_llmenvs.errors import EnvBuildError

__all__ = [
    "SANDBOX_MODES",
    "JailSpec",
    "Jailed",
    "SandboxLimits",
    "bwrap_argv",
    "check_bubblewrap",
    "jail_uid",
    "kill_and_confirm",
    "read_tail",
    "read_until",
    "run_jailed",
    "start_jailed",
    "wait_until",
]

SANDBOX_MODES = ("bubblewrap", "none")
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_START_TIMEOUT_S = 10.0
_KILL_TIMEOUT_S = 10.0
_READ_SIZE = 65536
_POLL_S = 0.2
TAIL_BYTES = 65536  # how much of a script's output is kept
_UID_LOW, _UID_HIGH = 1_000_000, 2_000_000_000  # unprivileged uids no account uses


@dataclass(frozen=True)
class SandboxLimits:
    """What one jailed process tree may use (rlimits, plus the size of its ``/tmp``).

    Attributes:
        processes: Most processes (and threads) the jail's uid may have (``RLIMIT_NPROC``).
        file_size_bytes: Largest file a process may write (``RLIMIT_FSIZE``).
        memory_bytes: Largest address space of one process (``RLIMIT_AS``).
        cpu_s: CPU seconds one process may use (``RLIMIT_CPU``).
        open_files: Most open files of one process (``RLIMIT_NOFILE``).
        tmp_bytes: Size of the private ``/tmp`` (a tmpfs, counted in memory).
    """

    processes: int = 256
    file_size_bytes: int = 256 << 20
    memory_bytes: int = 4 << 30
    cpu_s: int = 600
    open_files: int = 1024
    tmp_bytes: int = 64 << 20

    def prlimit_argv(self) -> list[str]:
        """The ``prlimit`` command that sets these limits (soft = hard) before the command."""
        return [
            "prlimit",
            f"--nproc={self.processes}",
            f"--fsize={self.file_size_bytes}",
            f"--as={self.memory_bytes}",
            f"--cpu={self.cpu_s}",
            f"--nofile={self.open_files}",
            "--core=0",
            "--",
        ]


@dataclass(frozen=True)
class JailSpec:
    """What a jailed process sees.

    Attributes:
        cwd: Its working directory (a path inside the jail).
        env: Its whole environment.
        writable: Host folders bound read-write, each at its own path.
        readable: Host folders bound read-only, each at its own path.
        allow_network: Share the host's network namespace (otherwise: loopback only, empty).
        limits: Its rlimits.
        uid: The unprivileged uid it runs as when started by root (ignored otherwise).
    """

    cwd: Path
    env: Mapping[str, str]
    writable: tuple[Path, ...] = ()
    readable: tuple[Path, ...] = ()
    allow_network: bool = False
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    uid: int = 65534


def jail_uid() -> int:
    """A fresh unprivileged uid for one episode (so its process limit is its own)."""
    return _UID_LOW + secrets.randbelow(_UID_HIGH - _UID_LOW)


def _privileged() -> bool:
    return os.geteuid() == 0


def bwrap_argv(spec: JailSpec, command: Sequence[str], info_fd: int | None = None) -> list[str]:
    """The ``bwrap`` command line that runs ``command`` as ``spec`` says."""
    argv = ["bwrap", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if not spec.allow_network:
        argv.append("--unshare-net")
    # --as-pid-1: the command is the namespace's init, so the jail ends when it does
    argv += ["--die-with-parent", "--new-session", "--as-pid-1", "--hostname", "sandbox"]
    if not _privileged():  # root drops to spec.uid with setpriv instead (no user namespace)
        argv += ["--unshare-user", "--disable-userns"]
    for system in _SYSTEM_DIRS:
        if os.path.islink(system):
            argv += ["--symlink", os.readlink(system), system]
        elif os.path.isdir(system):
            argv += ["--ro-bind", system, system]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--perms", "1777", "--size", str(spec.limits.tmp_bytes), "--tmpfs", "/tmp"]
    made: set[str] = {"/", "/tmp"}
    for path in (*spec.readable, *spec.writable):  # traversable mount points, whatever the
        for parent in reversed(path.parents):  # host's folders' modes
            name = str(parent)
            if name not in made and not any(name.startswith(s + "/") for s in _SYSTEM_DIRS):
                made.add(name)
                argv += ["--perms", "0755", "--dir", name]
    for path in spec.readable:
        argv += ["--ro-bind", str(path), str(path)]
    for path in spec.writable:
        argv += ["--bind", str(path), str(path)]
    argv += ["--remount-ro", "/", "--chdir", str(spec.cwd), "--clearenv"]
    for key, value in spec.env.items():
        argv += ["--setenv", key, value]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    argv.append("--")
    if _privileged():
        argv += [
            "setpriv",
            f"--reuid={spec.uid}",
            f"--regid={spec.uid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--",
        ]
    return argv + spec.limits.prlimit_argv() + list(command)


_FIX = (
    "install bubblewrap (apt-get install -y bubblewrap) on a host that allows namespaces, "
    "or pass sandbox='none' to run commands unsandboxed, as the current user"
)


@functools.cache
def check_bubblewrap() -> None:
    """Check once that this host can run a jail; raise :class:`EnvBuildError` saying how to
    fix it otherwise."""
    for tool in ("bwrap", "setpriv", "prlimit"):
        if shutil.which(tool) is None:
            raise EnvBuildError(f"the terminal sandbox needs {tool!r} on PATH: {_FIX}")
    spec = JailSpec(Path("/"), {"PATH": "/usr/bin:/bin"})
    try:
        probe = subprocess.run(
            bwrap_argv(spec, ["true"]),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EnvBuildError(f"the terminal sandbox's probe failed ({exc}): {_FIX}") from exc
    if probe.returncode != 0:
        raise EnvBuildError(
            f"bwrap cannot create namespaces here (exit {probe.returncode}: "
            f"{probe.stderr.strip()[-300:]!r}): {_FIX}"
        )


@dataclass
class Jailed:
    """A running jail: the outer ``bwrap`` process and its PID namespace.

    Attributes:
        process: The outer ``bwrap`` (its pipes are the jailed command's).
        init_pid: Host pid of the namespace's init.
        pid_namespace: The namespace's inode number (as in ``/proc/<pid>/ns/pid``).
    """

    process: subprocess.Popen[bytes]
    init_pid: int
    pid_namespace: int

    def members(self) -> list[int]:
        """Host pids of the processes still in the namespace."""
        return _pids_in_namespace(self.pid_namespace)

    def kill(self) -> None:
        """Kill every process in the namespace and wait (bounded) until none is left."""
        kill_and_confirm(self.process, self.init_pid, self.pid_namespace)


def start_jailed(
    spec: JailSpec, command: Sequence[str], *, stdin: int | None = subprocess.PIPE
) -> Jailed:
    """Start ``command`` in a jail; output and errors share one pipe.

    Raises:
        EnvBuildError: bwrap failed to set the jail up.
    """
    check_bubblewrap()
    read_fd, write_fd = os.pipe()
    try:
        process = subprocess.Popen(
            bwrap_argv(spec, command, write_fd),
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd="/",
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            pass_fds=(write_fd,),
            start_new_session=True,
        )
    except OSError as exc:
        os.close(read_fd)
        os.close(write_fd)
        raise EnvBuildError(f"cannot start bwrap: {exc}: {_FIX}") from exc
    os.close(write_fd)
    try:
        raw, _ = read_until(read_fd, time.monotonic() + _START_TIMEOUT_S)
    finally:
        os.close(read_fd)
    try:
        info = json.loads(raw)
        return Jailed(process, int(info["child-pid"]), int(info["pid-namespace"]))
    except (ValueError, KeyError, TypeError):
        _stop_outer(process)
        output = b""
        if process.stdout is not None:
            output, _ = read_until(process.stdout.fileno(), time.monotonic() + 1)
            process.stdout.close()
        if process.stdin is not None:
            process.stdin.close()
        raise EnvBuildError(
            f"bwrap failed to set the sandbox up: {output.decode(errors='replace')[-300:]!r}"
        ) from None


def read_until(
    fd: int, deadline: float, alive: subprocess.Popen[bytes] | None = None
) -> tuple[bytes, bool]:
    """Read ``fd`` until end of file, ``alive`` exits, or ``deadline``.

    Returns ``(data, finished)``: ``finished`` is False when the deadline came first.
    """
    data = bytearray()
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return bytes(data), False
        ready, _, _ = select.select([fd], [], [], min(remaining, _POLL_S))
        chunk = os.read(fd, _READ_SIZE) if ready else b""
        if chunk:
            data += chunk
        elif ready or (alive is not None and alive.poll() is not None):
            return bytes(data), True


def read_tail(
    fd: int, deadline: float, alive: subprocess.Popen[bytes], keep: int = TAIL_BYTES
) -> tuple[str, bool]:
    """Read ``fd`` as :func:`read_until` does, holding only its last ``keep`` bytes.

    Returns ``(text, finished)``; when more came than was kept, the text starts with a line
    saying how much: ``[output: 209715200 bytes, the last 65536 kept]``.
    """
    tail = bytearray()
    total = 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        ready, _, _ = select.select([fd], [], [], min(remaining, _POLL_S))
        chunk = os.read(fd, _READ_SIZE) if ready else b""
        if chunk:
            total += len(chunk)
            tail += chunk
            if len(tail) > 2 * keep:  # trimmed in batches, not per chunk
                del tail[:-keep]
        elif ready or alive.poll() is not None:
            break
    finished = remaining > 0
    text = bytes(tail[-keep:]).decode("utf-8", errors="replace")
    if total > keep:
        text = f"[output: {total} bytes, the last {keep} kept]\n" + text
    return text, finished


def run_jailed(spec: JailSpec, command: Sequence[str], timeout_s: float) -> tuple[int | None, str]:
    """``(exit status, or None past timeout_s; output)`` of ``command`` in a fresh jail.

    The jail is killed when the command ends, or at the deadline, whatever it left running
    (a child that keeps the output pipe open does not hold the caller past the deadline).
    Only the output's last :data:`TAIL_BYTES` are kept (see :func:`read_tail`).
    """
    jailed = start_jailed(spec, command, stdin=subprocess.DEVNULL)
    assert jailed.process.stdout is not None
    try:
        deadline = time.monotonic() + timeout_s
        output, _ = read_tail(jailed.process.stdout.fileno(), deadline, jailed.process)
        code = wait_until(jailed.process, deadline)
    finally:
        jailed.kill()
        jailed.process.stdout.close()
    return code, output


def wait_until(process: subprocess.Popen[bytes], deadline: float) -> int | None:
    """``process``'s exit status, waiting until ``deadline`` at most (None: still running)."""
    try:
        return process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def kill_and_confirm(process: subprocess.Popen[bytes], init_pid: int, pid_namespace: int) -> None:
    """SIGKILL the namespace's init (taking every process in it), reap ``process``, and wait
    until ``/proc`` shows no process left in the namespace.

    Raises:
        EnvBuildError: Processes were still in the namespace after the wait.
    """
    if _namespace_of(init_pid) == pid_namespace:  # not a recycled pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(init_pid, signal.SIGKILL)
    deadline = time.monotonic() + _KILL_TIMEOUT_S
    if wait_until(process, deadline) is None:
        _stop_outer(process)
    while True:
        left = _pids_in_namespace(pid_namespace)
        if not left:
            return
        if time.monotonic() > deadline:
            raise EnvBuildError(f"processes {left} outlived the kill of their sandbox")
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def _stop_outer(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=_KILL_TIMEOUT_S)


def _namespace_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def _pids_in_namespace(pid_namespace: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _namespace_of(int(entry)) == pid_namespace:
            found.append(int(entry))
    return found
