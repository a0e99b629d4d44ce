"""Length-prefixed pickle messages over a Unix stream socket, and socket handover.

Branch processes talk to the manager over socketpairs made by the manager itself, so there is
no port to pick and no race for one. A new branch's socket end travels to the process that
forks it as ancillary data (``SCM_RIGHTS``) right after the request naming it.
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

__all__ = ["receive", "receive_socket", "send", "send_socket"]

_HEADER = struct.Struct("!Q")


def send(sock: socket.socket, message: Any) -> None:
    """Send one pickled message."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def receive(sock: socket.socket) -> Any:
    """Receive one message; ``EOFError`` when the peer has closed its end."""
    (size,) = _HEADER.unpack(_receive_exactly(sock, _HEADER.size))
    return pickle.loads(_receive_exactly(sock, size))


def send_socket(sock: socket.socket, handed: socket.socket) -> None:
    """Hand ``handed``'s descriptor to the peer (the caller still closes its own copy)."""
    socket.send_fds(sock, [b"S"], [handed.fileno()])


def receive_socket(sock: socket.socket) -> socket.socket:
    """Receive a descriptor sent with :func:`send_socket`, as a socket."""
    data, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if data != b"S" or len(fds) != 1:
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
