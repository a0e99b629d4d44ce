"""ProcessFork branching: each branch is a copy-on-write fork of a process holding the env.

The process that forks is never the caller's: a trainer has threads, event loops, maybe CUDA
state, none of which survive ``fork``. The strategy starts one fresh, single-threaded
interpreter (the zygote, see :mod:`agile_llmenvs.branching._server`) and ships each
checkpointed env to it; the zygote forks a holder for the checkpoint, and every branch is a
fork of the holder, driven through a :class:`ForkedEnvironment` proxy over a socketpair. A
branch of a branch (a nested manager over a ``ForkedEnvironment``) forks that branch's
process directly, with no shipping at all.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import cloudpickle

from agile_llmenvs._imports import user_module_files
from agile_llmenvs.branching._wire import WireRefusedError, receive, send, send_socket, socketpair
from agile_llmenvs.branching.checkpoint import Checkpoint
from agile_llmenvs.core.types import Action, Environment, EnvironmentSpec, State, StepResult
from agile_llmenvs.errors import BranchError

__all__ = ["ForkedEnvironment", "ProcessForkStrategy"]

_HUGEPAGES = "glibc.malloc.hugetlb=1"


class _GoneError(BranchError):
    """A branch process stopped answering: it exited or was killed."""


class _Node:
    """A process of the branch tree that answers requests over one socket."""

    def __init__(self, sock: socket.socket, pid: int, parent: _Node | None) -> None:
        self.sock, self.pid, self.parent = sock, pid, parent
        self.closed = False
        self._lock = threading.Lock()

    def call(self, op: str, *args: Any, handover: socket.socket | None = None) -> Any:
        refused: WireRefusedError | None = None
        with self._lock:
            if self.closed:
                raise BranchError(f"branch process {self.pid} was released or closed")
            try:
                send(self.sock, (op, args))
                if handover is not None:
                    send_socket(self.sock, handover)
                status, value = receive(self.sock)
            except (EOFError, OSError) as exc:
                raise _GoneError(f"branch process {self.pid} is gone: {exc}") from exc
            except WireRefusedError as exc:  # not its reply: something else wrote to it
                refused = exc
        if refused is not None:
            self.close()
            raise WireRefusedError(
                f"branch process {self.pid} sent a message the manager refuses, so the branch "
                f"is closed: {refused}"
            ) from None
        if status == "error":
            raise value
        return value

    def spawn(self, op: str, *args: Any) -> tuple[socket.socket, int, Any]:
        """Have this process fork a child serving a new socket; returns the child's greeting."""
        mine, theirs = socketpair()
        try:
            pid = self.call(op, *args, handover=theirs)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        try:
            status, greeting = receive(mine)
        except (EOFError, OSError, WireRefusedError) as exc:
            mine.close()
            self.reap(pid)
            if isinstance(exc, WireRefusedError):
                raise WireRefusedError(
                    f"branch process {pid} sent a greeting the manager refuses: {exc}"
                ) from None
            raise BranchError(f"branch process {pid} died while starting: {exc}") from exc
        if status == "error":
            mine.close()
            self.reap(pid)
            raise greeting
        return mine, pid, greeting

    def reap(self, pid: int) -> None:
        """Wait for the child ``pid`` after its socket was closed (nothing to do if this
        process is gone: its children were handed to init, which reaps them)."""
        if self.closed:
            return
        with contextlib.suppress(_GoneError):
            self.call("reap", pid)

    def close(self) -> None:
        """Close this process's socket (it exits, with its children) and have it reaped."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.sock.close()
        if self.parent is not None:
            self.parent.reap(self.pid)


class ForkedEnvironment(_Node):
    """An :class:`Environment` living in a forked process, driven over a socket.

    It is what ``ProcessFork`` branches hand out. It forwards ``reset``, ``step`` and
    ``release`` (errors the env raises come back as the same exception types when the
    branching wire carries them: Python's and agile_llmenvs' own; others as ``RuntimeError``
    with their text), and
    ``close`` ends the process. A :class:`~agile_llmenvs.branching.BranchManager` over it
    forks its process for nested checkpoints.
    """

    def __init__(
        self, sock: socket.socket, pid: int, spec: EnvironmentSpec, parent: _Node | None
    ) -> None:
        super().__init__(sock, pid, parent)
        self._spec = spec

    @property
    def spec(self) -> EnvironmentSpec:
        """The spec of the env in the branch process."""
        return self._spec

    def reset(
        self, *, seed: int | None = None, options: Any = None
    ) -> tuple[State, dict[str, Any]]:
        """Reset the env in the branch process."""
        state, info = self.call("reset", seed, None if options is None else dict(options))
        return state, info

    def step(self, state: State, action: Action) -> StepResult:
        """Step the env in the branch process."""
        result: StepResult = self.call("step", state, action)
        return result

    def release(self, state: State) -> None:
        """Release ``state``'s episode in the branch process."""
        self.call("release", state)

    def fork(self) -> ForkedEnvironment:
        """A copy of this branch in a new process (its child), from where it is now."""
        sock, pid, (spec, _) = self.spawn("fork")
        return ForkedEnvironment(sock, pid, spec, parent=self)


class _Zygote(_Node):
    """The fresh interpreter that receives checkpointed envs and forks their holders."""

    def __init__(self, sock: socket.socket, process: subprocess.Popen[bytes]) -> None:
        super().__init__(sock, process.pid, parent=None)
        self.process = process

    @classmethod
    def start(cls) -> _Zygote:
        mine, theirs = socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        # Large allocations on transparent huge pages: a fork then copies one page-table
        # entry per 2 MB instead of 512, so branching a 500 MB env costs what a 10 MB one does.
        tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
        env["GLIBC_TUNABLES"] = ":".join([*tunables, _HUGEPAGES])
        process = subprocess.Popen(
            [sys.executable, "-m", "agile_llmenvs.branching._server", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
            start_new_session=True,
        )
        theirs.close()
        return cls(mine, process)

    def adopt(self, payload: bytes) -> tuple[ForkedEnvironment, State]:
        sock, pid, (spec, state) = self.spawn("adopt", payload)
        return ForkedEnvironment(sock, pid, spec, parent=self), state

    def close(self) -> None:
        super().close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ProcessForkStrategy:
    """Branch by forking a process that holds the env at the checkpoint.

    Exact for any env whose episodes live in its own memory (``spec.forkable``), whatever
    they hold; each branch costs one ``fork`` (copy-on-write, and flat in the env's size:
    branch processes back large allocations with transparent huge pages, through glibc's
    ``glibc.malloc.hugetlb=1`` tunable, so a fork copies one page-table entry per 2 MB).
    A local env is shipped to the branch processes once per checkpoint with ``cloudpickle``;
    an env that does not pickle is rebuilt there by replay from ``env_factory`` instead.

    Raises:
        BranchError: The platform has no ``fork``, or the env says it is not forkable.
    """

    name = "process_fork"

    def __init__(
        self, env: Environment, env_factory: Callable[[], Environment] | None = None
    ) -> None:
        if not hasattr(os, "fork"):
            raise BranchError("process_fork branching needs os.fork (Linux or macOS)")
        if not env.spec.forkable:
            raise BranchError(
                f"{env.spec.name!r} is not forkable (spec.forkable=False: its episodes hold "
                "processes, sockets or files outside this process's memory). Use "
                "strategy='action_replay' with an env_factory"
            )
        self.env, self.env_factory = env, env_factory
        self._zygote: _Zygote | None = None

    def hold(self, checkpoint: Checkpoint, env: Environment | None = None) -> _ForkCheckpoint:
        """Start a holder process with the env at ``checkpoint`` (a zygote that died is
        replaced first; its holders live on, each its own process).

        Args:
            checkpoint: The state to hold.
            env: The env to ship, as it is now (default: the strategy's): one strategy, and
                one zygote, then serves the checkpoints of many envs (a training batch's).

        Raises:
            BranchError: The env does not pickle and there is no ``env_factory`` to rebuild
                it from.
        """
        env = self.env if env is None else env
        if isinstance(env, ForkedEnvironment):
            return _ForkCheckpoint(env.fork(), checkpoint.state)
        if self._zygote is not None and self._zygote.process.poll() is not None:
            self._zygote.close()  # it died (killed, out of memory): a new one takes over
            self._zygote = None
        if self._zygote is None:
            self._zygote = _Zygote.start()
        holder, state = self._zygote.adopt(self._payload(checkpoint, env))
        return _ForkCheckpoint(holder, state)

    def close(self) -> None:
        """Stop the zygote."""
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None

    def _payload(self, checkpoint: Checkpoint, env: Environment) -> bytes:
        """The env (or its replay recipe), after the Python files loaded by path that the
        zygote must load before unpickling it (a file entrypoint's env class lives in one)."""
        files = {name: str(path) for name, path in user_module_files().items()}
        return pickle.dumps(("files", files, self._shipped(checkpoint, env)))

    def _shipped(self, checkpoint: Checkpoint, env: Environment) -> bytes:
        try:
            return bytes(cloudpickle.dumps(("env", env, checkpoint.state)))
        except Exception as exc:
            if self.env_factory is None:
                raise BranchError(
                    f"process_fork ships {env.spec.name!r} to its branch processes and "
                    f"it does not pickle ({type(exc).__name__}: {exc}); pass env_factory so "
                    "they can rebuild it by replay"
                ) from exc
            cp = checkpoint
            recipe = ("replay", self.env_factory, cp.seed, cp.task, cp.actions, cp.state)
            return bytes(cloudpickle.dumps(recipe))


class _ForkCheckpoint:
    """A holder process and the branches forked from it (branch() is thread-safe)."""

    def __init__(self, holder: ForkedEnvironment, state: State) -> None:
        self.holder, self.state = holder, state
        self.branches: list[ForkedEnvironment] = []
        self._lock = threading.Lock()

    def branch(self) -> tuple[Environment, State]:
        env = self.holder.fork()
        with self._lock:
            self.branches = [b for b in self.branches if not b.closed]
            self.branches.append(env)
        return env, self.state

    def release(self) -> None:
        with self._lock:
            branches, self.branches = self.branches, []
        for env in branches:
            env.close()
        self.holder.close()
