"""Terminal tasks from a folder, each episode a shell in a fresh temporary directory.

A tasks folder holds one sub-folder per task; sorted by name, their positions are the task
indices. A task folder holds ``instruction.md`` (what the agent is asked), ``verify.sh`` (run
in the working directory when the episode ends; it sets the reward) and optionally
``setup.sh`` (run in the fresh working directory before the first command).

The reward: a number the verifier writes to the file ``$REWARD_FILE`` (``1``, ``0.25``); when
it writes none, exit status 0 gives 1.0 and any other status 0.0. A verifier that outlives
its timeout gives 0.0. Scripts see ``TASK_DIR`` (the task folder), ``WORK_DIR`` and, when the
episode was reset with a seed, ``TASK_SEED``.

This is isolation for tidiness, not security: commands run as the current user.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agile_llmenvs.adapters.terminal.sandbox import Verdict
from agile_llmenvs.adapters.terminal.shell import CommandResult, ShellSession
from agile_llmenvs.errors import EnvBuildError

__all__ = ["LocalSandbox", "TaskFolder", "TerminalTask"]

WORK_DIR_PREFIX = "agile-llmenvs-terminal-"


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

    Raises:
        EnvBuildError: The folder is missing, holds no task, or a task lacks a file.
    """

    def __init__(
        self,
        tasks_dir: str | os.PathLike[str],
        *,
        script_timeout_s: float = 60.0,
        work_root: str | os.PathLike[str] | None = None,
    ) -> None:
        self.tasks_dir = Path(tasks_dir).resolve()
        self.script_timeout_s = script_timeout_s
        self.work_root = None if work_root is None else Path(work_root)
        self.tasks = _read_tasks(self.tasks_dir)

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
        self._root = tempfile.TemporaryDirectory(
            prefix=WORK_DIR_PREFIX, dir=folder.work_root, ignore_cleanup_errors=True
        )
        root = Path(self._root.name)
        self.work_dir = root / "work"
        self._reward_file = root / "verifier" / "reward"
        self.work_dir.mkdir()
        self._reward_file.parent.mkdir()
        self._env = _shell_env(self.work_dir)
        self._script_env = {**self._env, "TASK_DIR": str(task.directory)}
        self._script_env["WORK_DIR"] = str(self.work_dir)
        if seed is not None:
            self._script_env["TASK_SEED"] = str(seed)
        self._shell: ShellSession | None = None
        try:
            self._set_up()
            self._shell = ShellSession(self.work_dir, self._env)
        except BaseException:
            self.close()
            raise

    @property
    def shell_pid(self) -> int | None:
        """The shell's process id, while it runs."""
        return None if self._shell is None else self._shell.pid

    def run(self, command: str, timeout_s: float) -> CommandResult:
        """Run ``command`` in the episode's shell."""
        if self._shell is None:
            raise EnvBuildError(f"the sandbox of task {self.task.name!r} is closed")
        return self._shell.run(command, timeout_s)

    def verify(self) -> Verdict:
        """Run ``verify.sh`` in the working directory and read the reward it sets."""
        self._reward_file.unlink(missing_ok=True)
        env = {**self._script_env, "REWARD_FILE": str(self._reward_file)}
        code, output = _run_script(self.task.verify_script, self.work_dir, env, self._timeout_s)
        if code is None:
            return Verdict(0.0, output + f"\n[verifier timed out after {self._timeout_s} s]", None)
        if self._reward_file.is_file() and self._reward_file.read_text().strip():
            written = self._reward_file.read_text().strip()
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
        self._root.cleanup()

    def _set_up(self) -> None:
        script = self.task.setup_script
        if script is None:
            return
        code, output = _run_script(script, self.work_dir, self._script_env, self._timeout_s)
        if code != 0:
            how = f"timed out after {self._timeout_s} s" if code is None else f"exited {code}"
            raise EnvBuildError(
                f"setup.sh of task {self.task.name!r} {how}; its output ends: {output[-500:]!r}"
            )


def _shell_env(work_dir: Path) -> dict[str, str]:
    """A small, fixed environment: what a command sees does not depend on the caller's."""
    return {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": str(work_dir),
        "LC_ALL": "C",
        "TERM": "dumb",
    }


def _run_script(
    script: Path, cwd: Path, env: dict[str, str], timeout_s: float
) -> tuple[int | None, str]:
    """``(exit status or None on a timeout, output)`` of ``bash script`` in ``cwd``."""
    process = subprocess.Popen(
        ["bash", "--noprofile", "--norc", str(script)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=cwd,
        env=env,
        start_new_session=True,
    )
    try:
        out, _ = process.communicate(timeout=timeout_s)
        code: int | None = process.returncode
    except subprocess.TimeoutExpired:
        code = None
    finally:
        with contextlib.suppress(ProcessLookupError):  # what the script left running goes too
            os.killpg(process.pid, signal.SIGKILL)
    if code is None:
        out, _ = process.communicate()
    return code, out.decode("utf-8", errors="replace")
