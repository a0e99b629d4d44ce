"""The loop each branch process runs, and the entry point of the zygote that starts them.

Nothing here ever forks the caller's process. ``ProcessForkStrategy`` starts one *zygote*
(``python -m agile_llmenvs.branching._server``: a fresh interpreter, single-threaded, holding
no env). A checkpoint of a local env ships the env to the zygote, which forks a *holder*
serving that copy; each branch is a fork of the holder, so every branch starts from the
checkpoint's memory, shared copy-on-write. Every process serves one socket:

- ``reset`` / ``step`` / ``release``: the env's own calls;
- ``fork`` (a socket follows): fork a copy of this process serving the new socket;
- ``adopt`` (zygote only; a socket follows): fork a holder for a shipped env;
- ``reap``: wait for a child whose socket the manager closed.

A process whose socket reaches end-of-file closes its env, kills and reaps the children it
still has, and exits, so a manager that dies takes its whole tree with it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from agile_llmenvs.branching._wire import WireRefusedError, loads, receive, receive_socket, send
from agile_llmenvs.errors import BranchError

__all__ = ["main", "serve"]

_REAP_GRACE_S = 5.0


class _Process:
    """One serving process: the env it holds (``None`` in the zygote) and its children."""

    def __init__(self, sock: socket.socket, env: Any) -> None:
        self.sock, self.env = sock, env
        self.children: set[int] = set()

    def handle(self, op: str, args: tuple[Any, ...]) -> Any:
        if op == "fork":
            return self.fork(lambda: (self.env, None))
        if op == "adopt":
            (payload,) = args
            return self.fork(lambda: _load(payload))
        if op == "reap":
            (pid,) = args
            return self.reap(pid)
        if self.env is None:
            raise BranchError(f"the zygote holds no env to {op!r}")
        if op == "reset":
            seed, options = args
            return self.env.reset(seed=seed, options=options)
        if op == "step":
            state, action = args
            return self.env.step(state, action)
        if op == "release":
            (state,) = args
            return self.env.release(state)
        raise BranchError(f"unknown request {op!r}")

    def fork(self, load_env: Callable[[], tuple[Any, Any]]) -> int:
        new_sock = receive_socket(self.sock)
        threads = threading.active_count()
        if threads > 1:
            new_sock.close()
            raise BranchError(
                f"the env started {threads - 1} thread(s) in its branch process; forking it "
                "could deadlock. Branch it with strategy='action_replay' and an env_factory"
            )
        pid = os.fork()
        if pid == 0:
            # The child unwinds to run()'s loop before it serves, so the frames of this
            # request (and a shipped env's pickled bytes) are freed rather than kept forever.
            self.sock.close()
            raise _Forked(new_sock, load_env)
        new_sock.close()
        self.children.add(pid)
        return pid

    @classmethod
    def greet(cls, sock: socket.socket, load_env: Callable[[], tuple[Any, Any]]) -> _Process:
        """A child's start: load its env and tell the manager (spec, state), or the error."""
        process = cls(sock, None)
        try:
            process.env, state = load_env()
            send(sock, ("ok", (process.env.spec, state)))
        except BaseException as exc:
            send(sock, ("error", _portable(exc)))
            raise
        return process

    def reap(self, pid: int) -> None:
        """Wait for ``pid`` (its socket was closed, so it is exiting); kill it after a grace."""
        if pid not in self.children:
            return
        self.children.discard(pid)
        if not _exited_within(pid, _REAP_GRACE_S):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)

    def serve(self) -> None:
        """Answer requests until end-of-file, then shut down (a forked child escapes as
        :class:`_Forked` without shutting anything down)."""
        try:
            while True:
                try:
                    op, args = receive(self.sock)
                except (EOFError, OSError):
                    break
                except WireRefusedError as exc:  # read whole: the stream is still framed
                    send(self.sock, ("error", exc))
                    continue
                try:
                    reply = ("ok", self.handle(op, args))
                except _Forked:
                    raise
                except BaseException as exc:
                    reply = ("error", _portable(exc))
                send(self.sock, reply)
        except _Forked:
            raise
        except BaseException:
            self.shutdown()
            raise
        self.shutdown()

    def shutdown(self) -> None:
        for pid in self.children:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        self.children.clear()
        if self.env is not None:
            with contextlib.suppress(Exception):
                self.env.close()
        self.sock.close()


def _exited_within(pid: int, timeout_s: float) -> bool:
    """Whether child ``pid`` exits within ``timeout_s`` (it is not reaped here)."""
    if hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return True  # already gone
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        try:
            return bool(poller.poll(timeout_s * 1000))
        finally:
            os.close(fd)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        time.sleep(0.0005)
    return False


def _load(payload: bytes) -> tuple[Any, Any]:
    """The env a checkpoint shipped, and its state: pickled whole, or rebuilt by replay.

    The one full unpickling of the branch tree: ``payload`` comes from the manager (an
    ``adopt`` request to the zygote), never from a branch.
    """
    kind, *rest = pickle.loads(payload)
    if kind == "files":  # the files loaded by path in the trainer, loaded here first
        files, inner = rest
        from pathlib import Path

        from agile_llmenvs._imports import load_module_file

        for path in files.values():
            load_module_file(Path(path))
        return _load(inner)
    if kind == "env":
        env, state = rest
        return env, state
    factory, seed, options, actions, expect = rest
    from agile_llmenvs.core.replay import replay

    env = factory()
    try:
        return env, replay(env, actions, seed=seed, options=options, expect=expect)
    except BaseException:
        env.close()
        raise


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling and the wire carries it back (see
    :class:`~agile_llmenvs.branching._wire.WireUnpickler`), else a RuntimeError carrying
    its text."""
    try:
        loads(pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


class _Forked(BaseException):
    """Raised in a freshly forked child to unwind it to :func:`serve`'s loop."""

    def __init__(self, sock: socket.socket, load_env: Callable[[], tuple[Any, Any]]) -> None:
        super().__init__()
        self.sock, self.load_env = sock, load_env


def serve(sock: socket.socket, env: Any) -> None:
    """Serve ``env`` over ``sock`` until the peer closes it; forked children continue here.

    Every process of the tree runs this loop: the zygote (``env=None``) and, after a fork
    unwinds to it, each holder and branch.
    """
    process = _Process(sock, env)
    while True:
        try:
            process.serve()
            return
        except _Forked as forked:
            child_sock, load_env = forked.sock, forked.load_env
            del forked
            process = _Process.greet(child_sock, load_env)
            del load_env


def main() -> None:
    """The zygote: serve the socket whose descriptor is the first argument."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the manager's process decides when to stop
    code = 0
    try:
        fd = int(sys.argv[1])
        os.set_inheritable(fd, False)  # passed with pass_fds, so inheritable until now
        serve(socket.socket(fileno=fd), None)
    except BaseException:
        code = 1
    finally:
        os._exit(code)  # forked children end here too: never run the zygote's exit hooks


if __name__ == "__main__":
    main()
