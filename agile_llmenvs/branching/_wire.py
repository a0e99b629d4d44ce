"""Length-prefixed pickle messages over a Unix stream socket, and socket handover.

Branch processes talk to the manager over socketpairs made by the manager itself, so there is
no port to pick and no race for one. A new branch's socket end travels to the process that
forks it as ancillary data (``SCM_RIGHTS``) right after the request naming it.

Two rules keep a branch's env (and whatever it runs: a shell, a tool) from reaching into the
manager through these sockets:

- **Close-on-exec.** Every branch socket, made here or received, is non-inheritable, so a
  program an env starts (``subprocess``, ``os.system``, a pty) never holds one.
- **Control messages are data.** :func:`receive` unpickles with an allow-list
  (:class:`WireUnpickler`): plain builtins, the branch protocol's own types (states, actions,
  step results, specs, tool calls), agile_llmenvs' and Python's exception classes,
  and numpy arrays and scalars. A message naming anything else (``os.system``, an env's own
  class) is refused with :class:`WireRefusedError` and nothing in it runs.

The one full pickle is a checkpoint's shipped env (``adopt``): it travels inside a request as
``bytes``, from the manager to the zygote only, never from a branch back to the manager.
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
import socket
import struct
from typing import Any

from agile_llmenvs.errors import BranchError

__all__ = [
    "WireRefusedError",
    "WireUnpickler",
    "loads",
    "receive",
    "receive_socket",
    "send",
    "send_socket",
    "socketpair",
]

_HEADER = struct.Struct("!Q")

#: Builtins a message may name (besides exception classes); containers, str, bytes and
#: numbers have their own pickle opcodes and name nothing.
_BUILTINS = frozenset({"complex", "range", "slice", "frozenset", "set", "bytearray"})
#: Globals a message may name outside builtins, exactly (module, qualified name).
_ALLOWED = frozenset(
    {
        ("agile_llmenvs.core.types", "State"),
        ("agile_llmenvs.core.types", "Action"),
        ("agile_llmenvs.core.types", "StepResult"),
        ("agile_llmenvs.core.types", "EnvironmentSpec"),
        ("agile_llmenvs.backends.types", "ToolCall"),
        ("agile_llmenvs.backends.types", "Generation"),
        ("agile_llmenvs.backends.types", "Completion"),
        ("agile_llmenvs.backends.types", "SamplingParams"),
        ("numpy", "dtype"),
        ("numpy", "ndarray"),
        *(
            (f"numpy.{core}.{module}", name)
            for core in ("core", "_core")
            for module, name in [
                ("multiarray", "scalar"),
                ("multiarray", "_reconstruct"),
                ("numeric", "_frombuffer"),
            ]
        ),
    }
)


class WireRefusedError(BranchError):
    """A branch message named a global the branching wire does not carry; nothing ran."""


class WireUnpickler(pickle.Unpickler):
    """Unpickles control messages: only the globals listed in this module's docstring.

    Raises:
        WireRefusedError: (from ``load``) the message names any other global.
    """

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and "." not in name:
            found = getattr(builtins, name, None)
            allowed = name in _BUILTINS or (
                isinstance(found, type) and issubclass(found, BaseException)
            )
            if allowed:
                return found
        elif (module, name) in _ALLOWED or _is_error_class(module, name):
            return super().find_class(module, name)
        raise WireRefusedError(
            f"the branching wire refused a message naming {module}.{name}: it carries plain "
            "data, states, actions, step results, errors and numpy arrays, nothing else"
        )


def _is_error_class(module: str, name: str) -> bool:
    """Whether ``module.name`` is an exception class of :mod:`agile_llmenvs.errors`."""
    if module != "agile_llmenvs.errors" or "." in name:
        return False
    from agile_llmenvs import errors

    found = getattr(errors, name, None)
    return isinstance(found, type) and issubclass(found, BaseException)


def loads(data: bytes) -> Any:
    """Unpickle one control message with :class:`WireUnpickler`.

    Raises:
        WireRefusedError: the message names a global the wire does not carry.
    """
    return WireUnpickler(io.BytesIO(data)).load()


def send(sock: socket.socket, message: Any) -> None:
    """Send one pickled message."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def receive(sock: socket.socket) -> Any:
    """Receive one message; ``EOFError`` when the peer has closed its end.

    Raises:
        WireRefusedError: the message names a global the wire does not carry (the whole
            message was read: the stream stays framed).
    """
    (size,) = _HEADER.unpack(_receive_exactly(sock, _HEADER.size))
    return loads(_receive_exactly(sock, size))


def socketpair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of Unix stream sockets, both close-on-exec."""
    pair = socket.socketpair()
    for end in pair:
        end.set_inheritable(False)
    return pair


def send_socket(sock: socket.socket, handed: socket.socket) -> None:
    """Hand ``handed``'s descriptor to the peer (the caller still closes its own copy)."""
    socket.send_fds(sock, [b"S"], [handed.fileno()])


def receive_socket(sock: socket.socket) -> socket.socket:
    """Receive a descriptor sent with :func:`send_socket`, as a close-on-exec socket.

    Descriptors received with ``SCM_RIGHTS`` are inheritable by default: each one is made
    close-on-exec at once, and any beyond the one expected is closed.
    """
    data, fds, _, _ = socket.recv_fds(sock, 1, 1)
    for fd in fds:
        os.set_inheritable(fd, False)
    if data != b"S" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise EOFError("the peer closed its end before handing over a socket")
    return socket.socket(fileno=fds[0])


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the peer closed its end")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
