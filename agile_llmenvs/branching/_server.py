"""The loop each branch process runs, and the entry point of the zygote that starts them.

Nothing here ever forks the caller's process. ``ProcessForkStrategy`` starts one *zygote*
(``python -m agile_llmenvs.branching._server``: a fresh interpreter, single-threaded, holding
no env). A checkpoint of a local env ships the env to the zygote, which forks a *holder*
serving that copy; each branch is a fork of the holder, so every branch starts from the
checkpoint's memory, shared copy-on-write. Every process serves one socket:

- ``reset`` / ``step`` / ``release`` / ``spec``: the env's own calls;
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
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from agile_llmenvs.branching._wire import receive, receive_socket, send
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
        if op == "spec":
            return self.env.spec
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
        if pid == 0:  # the child: serve the new socket, never return into this loop
            code = 0
            try:
                self.sock.close()
                self.children.clear()
                _Process(new_sock, None).greet_and_serve(load_env)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        new_sock.close()
        self.children.add(pid)
        return pid

    def greet_and_serve(self, load_env: Callable[[], tuple[Any, Any]]) -> None:
        try:
            self.env, state = load_env()
            send(self.sock, ("ok", (self.env.spec, state)))
        except BaseException as exc:
            send(self.sock, ("error", _portable(exc)))
            return
        self.serve()

    def reap(self, pid: int) -> None:
        if pid not in self.children:
            return
        self.children.discard(pid)
        deadline = time.monotonic() + _REAP_GRACE_S
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(0.0005)

    def serve(self) -> None:
        try:
            while True:
                try:
                    op, args = receive(self.sock)
                except (EOFError, OSError):
                    return
                try:
                    reply = ("ok", self.handle(op, args))
                except BaseException as exc:
                    reply = ("error", _portable(exc))
                send(self.sock, reply)
        finally:
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


def _load(payload: bytes) -> tuple[Any, Any]:
    """The env a checkpoint shipped, and its state: pickled whole, or rebuilt by replay."""
    kind, *rest = pickle.loads(payload)
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
    """``exc`` if it survives pickling, else a RuntimeError carrying its text."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def serve(sock: socket.socket, env: Any) -> None:
    """Serve ``env`` over ``sock`` until the peer closes it (used by the zygote and tests)."""
    _Process(sock, env).serve()


def main() -> None:
    """The zygote: serve the socket whose descriptor is the first argument."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the manager's process decides when to stop
    serve(socket.socket(fileno=int(sys.argv[1])), None)


if __name__ == "__main__":
    main()
