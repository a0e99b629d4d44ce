"""Slow and idle clients against each way of serving an env: how long they hold it.

Three servers of the same env, each in its own process (``_remote_servers.py``):
``agile-llmenvs serve``'s :class:`~agile_llmenvs.transport.OpenEnvServer` (``ours``), our
ASGI app under plain ``uvicorn`` (``asgi``), and under uvicorn with
:mod:`agile_llmenvs.transport.uvicorn_limits` (``asgi_guarded``: its request deadline of 10 s,
``--limit-concurrency 1024``). Against each, at once:

- ``slowloris``: ``--slow`` connections that send a request's headers a byte a second;
- ``slow_body``: ``--slow`` connections that send a ``POST /step`` body a byte a second;
- ``flood``: ``--idle`` connections that connect and send nothing.

Figures, per server: the connections of each kind still open ``--hold`` seconds later
(``*_open``), and whether a legitimate ``GET /health`` got its 200 meanwhile
(``health_ok``, its seconds ``health_s``). ``guarded_slowloris_open`` and
``guarded_flood_open`` are the guarded server's (target 0, as ``ours``). Last line: JSON.

    python bench/slow_clients.py [--slow 300] [--idle 2000] [--hold 20]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
KINDS = ("ours", "asgi", "asgi_guarded")


def start(kind: str) -> tuple[subprocess.Popen[str], int]:
    """A server of ``kind`` in its own process, and its port once it answers."""
    process = subprocess.Popen(
        [sys.executable, str(HERE / "_remote_servers.py"), kind],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout is not None
    port = int(process.stdout.readline())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
            return process, port
        time.sleep(0.1)
    raise RuntimeError(f"{kind} did not answer /health within 60 s")


def connect(port: int, count: int, first: bytes) -> list[socket.socket]:
    clients = []
    for _ in range(count):
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        if first:
            client.sendall(first)
        clients.append(client)
    return clients


def still_open(clients: list[socket.socket]) -> int:
    count = 0
    for client in clients:
        client.setblocking(False)
        try:
            count += client.recv(1) != b""
        except BlockingIOError:
            count += 1
        except OSError:
            pass
    return count


def attack(port: int, slow: int, idle: int, hold_s: float) -> dict[str, Any]:
    groups = {
        "slowloris": connect(port, slow, b"GET /health HTTP/1.1\r\n"),
        "slow_body": connect(
            port,
            slow,
            b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n{",
        ),
        "flood": connect(port, idle, b""),
    }
    start_s = time.monotonic()
    health_s: float | None = None
    while time.monotonic() - start_s < hold_s:
        for name in ("slowloris", "slow_body"):
            for client in groups[name]:
                with contextlib.suppress(OSError):
                    client.sendall(b"X" if name == "slowloris" else b" ")
        if health_s is None and time.monotonic() - start_s > hold_s / 2:
            asked = time.monotonic()
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).close()
                health_s = time.monotonic() - asked
        time.sleep(1.0)
    result: dict[str, Any] = {f"{name}_open": still_open(c) for name, c in groups.items()}
    result["health_ok"] = health_s is not None
    result["health_s"] = round(health_s, 3) if health_s is not None else None
    for clients in groups.values():
        for client in clients:
            client.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slow", type=int, default=300)
    parser.add_argument("--idle", type=int, default=2000)
    parser.add_argument("--hold", type=float, default=20.0)
    args = parser.parse_args()
    result: dict[str, Any] = {"slow": args.slow, "idle": args.idle, "hold_s": args.hold}
    for kind in KINDS:
        process, port = start(kind)
        try:
            result[kind] = attack(port, args.slow, args.idle, args.hold)
        finally:
            process.kill()
            process.wait()
        print(kind, result[kind], file=sys.stderr, flush=True)
    guarded = result["asgi_guarded"]
    result["guarded_slowloris_open"] = guarded["slowloris_open"]
    result["guarded_slow_body_open"] = guarded["slow_body_open"]
    result["guarded_flood_open"] = guarded["flood_open"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
