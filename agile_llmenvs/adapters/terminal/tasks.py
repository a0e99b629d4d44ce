"""Terminal tasks from a folder, each episode a shell in a fresh temporary directory.

A tasks folder holds one sub-folder per task; sorted by name, their positions are the task
indices. A task folder holds ``instruction.md`` (what the agent is asked), ``verify.sh`` (run
when the episode ends; it sets the reward) and optionally ``setup.sh`` (run in the fresh
working directory before the first command).

The reward: a number the verifier writes to the file ``$REWARD_FILE`` (``1``, ``0.25``); when
it writes none, exit status 0 gives 1.0 and any other status 0.0. A verifier that outlives
its timeout gives 0.0. Scripts see ``TASK_DIR`` (the task folder), ``WORK_DIR`` and, when the
episode was reset with a seed, ``TASK_SEED``.

The verifier trusts nothing the policy wrote: it starts in a fresh empty folder that is also
its ``HOME`` (not the work folder, the policy's ``HOME``), with an environment of its own
(:data:`VERIFIER_ENV`: no user site-packages, no script folder on ``sys.path``, no git config
but the repository's), so no start-up file of Python, git or a shell in the work folder runs.
It finds the policy's files at ``$WORK_DIR``, and must read them as data.

By default (``sandbox="bubblewrap"``) every episode runs in bubblewrap jails (see
:mod:`agile_llmenvs.adapters.terminal.jail` and docs/terminal.md's threat model): the shell
sees its working directory (read-write, its ``HOME``), the system folders read-only, a
private ``/tmp``, no network unless ``allow_network``, and runs as an unprivileged uid of its
own under rlimits. The task folder is bound only into the setup's and the verifier's jails.
The verifier runs after every process of the episode's shell is gone, in a jail of its own,
and writes its reward into a folder the shell never sees. ``sandbox="none"`` runs commands
unsandboxed, as the current user (for hosts without namespaces; it logs a warning).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import stat
import subprocess
import tempfile
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

from agile_llmenvs.adapters.terminal.jail import (
    SANDBOX_MODES,
    JailSpec,
    SandboxLimits,
    check_bubblewrap,
    jail_uid,
    read_tail,
    run_jailed,
    wait_until,
)
from agile_llmenvs.adapters.terminal.sandbox import Verdict
from agile_llmenvs.adapters.terminal.shell import CommandResult, ShellSession
from agile_llmenvs.errors import EnvBuildError

__all__ = ["LocalSandbox", "TaskFolder", "TerminalTask"]

WORK_DIR_PREFIX = "agile-llmenvs-terminal-"
JAIL_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_MAX_REWARD_BYTES = 4096
# What every verifier's environment holds besides PATH, HOME and the task's variables: no
# start-up code from a folder the policy wrote (Python ignores PYTHONSAFEPATH before 3.11;
# the verifier's working folder is fresh and empty anyway).
VERIFIER_ENV = {
    "PYTHONNOUSERSITE": "1",
    "PYTHONSAFEPATH": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_NOSYSTEM": "1",
}
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TerminalTask:
    """One task folder.

    Attributes:
        name: The folder's name.
        directory: The folder.
    """

    name: str
    directory: Path

    @property
    def instruction(self) -> str:
        """The text of ``instruction.md``."""
        return (self.directory / "instruction.md").read_text(encoding="utf-8").strip()

    @property
    def setup_script(self) -> Path | None:
        """``setup.sh``, when the task has one."""
        path = self.directory / "setup.sh"
        return path if path.is_file() else None

    @property
    def verify_script(self) -> Path:
        """``verify.sh``."""
        return self.directory / "verify.sh"


class TaskFolder:
    """The tasks of a folder, as a :class:`~agile_llmenvs.adapters.terminal.TaskSource`.

    Args:
        tasks_dir: The folder of task folders (names starting with ``.`` or ``_`` are skipped).
        script_timeout_s: Most seconds ``setup.sh`` or ``verify.sh`` may run.
        work_root: Where the episodes' temporary directories are made (the system's
            temporary directory by default).
        sandbox: ``"bubblewrap"`` (jail every command; the default) or ``"none"`` (run
            unsandboxed, as the current user; logs a warning).
        allow_network: Let the episode's commands and scripts use the host's network.
        limits: The jails' rlimits (:class:`SandboxLimits`' defaults when ``None``).

    Raises:
        EnvBuildError: The folder is missing, holds no task, or a task lacks a file; or
            ``sandbox="bubblewrap"`` and this host cannot run bubblewrap jails.
        ValueError: ``sandbox`` is neither mode.
    """

    def __init__(
        self,
        tasks_dir: str | os.PathLike[str],
        *,
        script_timeout_s: float = 60.0,
        work_root: str | os.PathLike[str] | None = None,
        sandbox: str = "bubblewrap",
        allow_network: bool = False,
        limits: SandboxLimits | None = None,
    ) -> None:
        if sandbox not in SANDBOX_MODES:
            raise ValueError(f"sandbox must be one of {SANDBOX_MODES}, got {sandbox!r}")
        self.tasks_dir = Path(tasks_dir).resolve()
        self.script_timeout_s = script_timeout_s
        self.work_root = None if work_root is None else Path(work_root).resolve()
        self.sandbox = sandbox
        self.allow_network = allow_network
        self.limits = limits or SandboxLimits()
        self.tasks = _read_tasks(self.tasks_dir)
        if sandbox == "bubblewrap":
            check_bubblewrap()
        else:
            _log.warning(
                "TERMINAL ENV UNSANDBOXED (sandbox='none'): commands from %s run as this "
                "user, with its files, network, processes and environment; a policy can "
                "forge its reward and outlive its episode",
                self.tasks_dir,
            )

    @property
    def task_names(self) -> tuple[str, ...]:
        """The tasks' names, sorted: a task's position is its ``task_index``."""
        return tuple(task.name for task in self.tasks)

    def instruction(self, task_index: int) -> str:
        """The instruction of task ``task_index``."""
        return self.tasks[task_index].instruction

    def open(self, task_index: int, seed: int | None) -> LocalSandbox:
        """A fresh working directory and shell for task ``task_index``, after its setup."""
        return LocalSandbox(self.tasks[task_index], self, seed)


def _read_tasks(tasks_dir: Path) -> tuple[TerminalTask, ...]:
    if not tasks_dir.is_dir():
        raise EnvBuildError(f"tasks_dir {str(tasks_dir)!r} is not a directory of task folders")
    folders = sorted(
        p for p in tasks_dir.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
    )
    if not folders:
        raise EnvBuildError(
            f"tasks_dir {str(tasks_dir)!r} holds no task folder; each task is a folder with "
            "instruction.md and verify.sh"
        )
    for folder in folders:
        for needed in ("instruction.md", "verify.sh"):
            if not (folder / needed).is_file():
                raise EnvBuildError(
                    f"task {folder.name!r} in {str(tasks_dir)!r} has no {needed}; each task "
                    "folder needs instruction.md and verify.sh (setup.sh is optional)"
                )
    return tuple(TerminalTask(folder.name, folder) for folder in folders)


class LocalSandbox:
    """One episode of a folder task: a temporary directory, its setup, and a shell in it.

    Raises:
        EnvBuildError: ``setup.sh`` failed or outlived its timeout (nothing is left behind).
    """

    def __init__(self, task: TerminalTask, folder: TaskFolder, seed: int | None) -> None:
        self.task = task
        self._timeout_s = folder.script_timeout_s
        self._jailed = folder.sandbox == "bubblewrap"
        root = Path(tempfile.mkdtemp(prefix=WORK_DIR_PREFIX, dir=folder.work_root))
        self._remove_root = weakref.finalize(self, _remove_quietly, root)  # once, at close
        self.work_dir = root / "work"
        self._verifier_dir = root / "verifier"
        self._reward_file = self._verifier_dir / "reward"
        self.work_dir.mkdir()
        self._uid = jail_uid()
        if self._jailed:
            os.chown(self.work_dir, self._uid, self._uid)
        self._env = _shell_env(self.work_dir, jailed=self._jailed)
        self._task_vars = {"TASK_DIR": str(task.directory), "WORK_DIR": str(self.work_dir)}
        if seed is not None:
            self._task_vars["TASK_SEED"] = str(seed)
        self._spec = JailSpec(
            self.work_dir,
            self._env,
            writable=(self.work_dir,),
            allow_network=folder.allow_network,
            limits=folder.limits,
            uid=self._uid,
        )
        self._shell: ShellSession | None = None
        try:
            self._set_up()
            self._shell = ShellSession(
                self.work_dir, self._env, jail=self._spec if self._jailed else None
            )
        except BaseException:
            self.close()
            raise

    @property
    def shell_pid(self) -> int | None:
        """The shell's process id (the outer ``bwrap``'s when jailed), while it runs."""
        return None if self._shell is None else self._shell.pid

    @property
    def shell(self) -> ShellSession | None:
        """The episode's shell, while it runs."""
        return self._shell

    def run(self, command: str, timeout_s: float) -> CommandResult:
        """Run ``command`` in the episode's shell."""
        if self._shell is None:
            raise EnvBuildError(f"the sandbox of task {self.task.name!r} is closed")
        return self._shell.run(command, timeout_s)

    def verify(self) -> Verdict:
        """End the shell (every process it started), then run ``verify.sh`` in a fresh folder
        of its own (its cwd and ``HOME``) and read the reward it sets."""
        if self._shell is not None:
            self._shell.close()
            self._shell = None
        home = self._fresh_verifier_dir()
        env = {
            **self._env,
            **VERIFIER_ENV,
            **self._task_vars,
            "HOME": str(home),
            "REWARD_FILE": str(self._reward_file),
        }
        code, output = self._script(self.task.verify_script, env, home)
        if code is None:
            return Verdict(0.0, output + f"\n[verifier timed out after {self._timeout_s} s]", None)
        written = _read_reward(self._reward_file)
        if written:
            try:
                return Verdict(float(written), output, code)
            except ValueError:
                note = f"\n[REWARD_FILE holds {written[:80]!r}, not a number: reward 0.0]"
                return Verdict(0.0, output + note, code)
        return Verdict(1.0 if code == 0 else 0.0, output, code)

    def close(self) -> None:
        """Kill the shell and everything it started, and delete the temporary directory."""
        if self._shell is not None:
            self._shell.close()
            self._shell = None
        self._remove_root()

    def _fresh_verifier_dir(self) -> Path:
        """An empty ``verifier/home`` beside the work folder, which only the verifier's jail
        sees; returns the home."""
        remove_tree(self._verifier_dir)
        home = self._verifier_dir / "home"
        home.mkdir(parents=True)
        if self._jailed:
            for folder in (self._verifier_dir, home):
                os.chown(folder, self._uid, self._uid)
        return home

    def _set_up(self) -> None:
        script = self.task.setup_script
        if script is None:
            return
        code, output = self._script(script, {**self._env, **self._task_vars}, self.work_dir)
        if code != 0:
            how = f"timed out after {self._timeout_s} s" if code is None else f"exited {code}"
            raise EnvBuildError(
                f"setup.sh of task {self.task.name!r} {how}; its output ends: {output[-500:]!r}"
            )

    def _script(self, script: Path, env: dict[str, str], cwd: Path) -> tuple[int | None, str]:
        """Run ``script`` in ``cwd``: the work folder (setup) or the verifier's home."""
        command = ["bash", "--noprofile", "--norc", str(script)]
        if not self._jailed:
            return _run_script(command, cwd, env, self._timeout_s)
        writable = (self.work_dir,) if cwd == self.work_dir else (self.work_dir, self._verifier_dir)
        spec = replace(
            self._spec,
            cwd=cwd,
            env=env,
            writable=writable,
            readable=(self.task.directory,),
        )
        return run_jailed(spec, command, self._timeout_s)


def _read_reward(path: Path) -> str:
    """The reward file's text ("" when absent); never follows a link, reads a bounded size."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        if not os.path.isfile(f"/proc/self/fd/{fd}"):
            return ""
        return os.read(fd, _MAX_REWARD_BYTES).decode("utf-8", errors="replace").strip()
    finally:
        os.close(fd)


def _shell_env(work_dir: Path, *, jailed: bool) -> dict[str, str]:
    """A small, fixed environment: what a command sees does not depend on the caller's."""
    path = JAIL_PATH if jailed else os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    return {"PATH": path, "HOME": str(work_dir), "LC_ALL": "C", "TERM": "dumb"}


def _run_script(
    command: list[str], cwd: Path, env: dict[str, str], timeout_s: float
) -> tuple[int | None, str]:
    """``(exit status or None on a timeout, output)`` of ``command`` in ``cwd``, unsandboxed;
    bounded by ``timeout_s`` even when a child the script left keeps the output pipe open."""
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=cwd,
        env=env,
        start_new_session=True,
    )
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    try:
        output, _ = read_tail(process.stdout.fileno(), deadline, process)
        code = wait_until(process, deadline)
    finally:
        with contextlib.suppress(ProcessLookupError):  # what the script left running goes too
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)
        process.stdout.close()
    return code, output


def remove_tree(root: Path) -> None:
    """Delete ``root`` and everything under it, however the policy built it.

    Iterative, so no depth reaches a recursion limit; walks by file descriptor, one folder
    open at a time, so no path grows past ``PATH_MAX``; never follows a link; and opens up
    folders made unreadable or unwritable (``chmod 000``) before entering them.
    """
    try:
        if not stat.S_ISDIR(os.lstat(root).st_mode):
            root.unlink()
            return
        os.chmod(root, 0o700)
    except FileNotFoundError:
        return
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    fd = os.open(root, flags)
    # per folder entered, outermost first: its name and its sub-folders still to delete
    stack: list[tuple[str, list[str]]] = [("", _unlink_all_but_folders(fd))]
    try:
        while True:
            name, pending = stack[-1]
            if pending:
                child = pending.pop()
                os.chmod(child, 0o700, dir_fd=fd)  # a folder, and nothing runs to swap it
                child_fd = os.open(child, flags, dir_fd=fd)
                os.close(fd)
                fd = child_fd
                stack.append((child, _unlink_all_but_folders(fd)))
                continue
            stack.pop()
            if not stack:
                break
            parent_fd = os.open("..", flags, dir_fd=fd)
            os.close(fd)
            fd = parent_fd
            os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(root)


def _remove_quietly(root: Path) -> None:
    """:func:`remove_tree`, logging (not raising) what it could not delete."""
    try:
        remove_tree(root)
    except OSError as exc:
        _log.warning("could not delete the episode folder %s: %s", root, exc)


def _unlink_all_but_folders(fd: int) -> list[str]:
    """Unlink every entry of the open folder ``fd`` but folders; the folders' names."""
    folders = []
    for name in os.listdir(fd):
        if stat.S_ISDIR(os.lstat(name, dir_fd=fd).st_mode):
            folders.append(name)
        else:
            os.unlink(name, dir_fd=fd)
    return folders
