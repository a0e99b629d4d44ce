"""Remote env transport: step latency and throughput against a raw WebSocket echo floor.

Three transports, each server in its own process, measured in interleaved rounds (these
machines drift by up to 2x from minute to minute):

* ``floor``: a raw ``websockets`` echo server and client — the unavoidable work;
* ``openenv``: OpenEnv's own client against OpenEnv's own ``create_app`` server (uvicorn,
  compression off, capacity 256), hosting the same env;
* ``ours``: :class:`RemoteEnvClient` against :class:`OpenEnvServer`.

Single-session latency uses each client's blocking API, with the client on one CPU and the
server on another (where there are two): unpinned, the scheduler's shuffling of the three
threads in play (caller, client reader, server loop) across two cores spread each side's
samples from 1x to 3x their pinned median, run to run. Throughput at N sessions drives N
sessions concurrently through each client's async API on one event loop, unpinned, with
client and server each using a whole core: any other process slows a round, so steps/s is
each transport's best round (the median beside it). The last line is JSON: p50/p99 latency
(µs) and steps/s per transport, and the ratios the targets read (ours over OpenEnv's steps/s
at 64 sessions >= 2, ours over the echo floor's >= 0.6).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MESSAGE = "y" * 200


def start_server(kind: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_remote_servers.py"), kind],
        stdout=subprocess.PIPE,
        text=True,
        cwd=HERE.parent,
    )
    assert proc.stdout is not None
    port = proc.stdout.readline().strip()
    time.sleep(0.5 if kind != "openenv" else 2.0)
    return proc, f"http://127.0.0.1:{port}"


# -- blocking single-session latency --------------------------------------------------------


def latency_floor(url: str, steps: int) -> list[float]:
    from websockets.sync.client import connect

    frame = json.dumps({"type": "step", "data": {"message": MESSAGE}})
    with connect(url.replace("http", "ws") + "/ws", compression=None) as ws:
        return _timed(lambda: (ws.send(frame), ws.recv()), steps)


def latency_openenv(url: str, steps: int) -> list[float]:
    from openenv.core import GenericEnvClient

    client = GenericEnvClient(base_url=url).sync()
    with client:
        client.reset()
        return _timed(lambda: client.step({"message": MESSAGE}), steps)


def latency_ours(url: str, steps: int) -> list[float]:
    from agile_llmenvs.transport import RemoteEnvClient

    with RemoteEnvClient(url) as client:
        client.reset()
        return _timed(lambda: client.step(MESSAGE), steps)


@contextlib.contextmanager
def pinned(server_pid: int) -> Iterator[None]:
    """This thread (and the threads it starts) on CPU 0, every thread of the server on CPU 1."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        yield
        return
    tasks = [int(t) for t in os.listdir(f"/proc/{server_pid}/task")]
    before = {t: os.sched_getaffinity(t) for t in [0, *tasks]}
    os.sched_setaffinity(0, {cpus[0]})
    for task in tasks:
        os.sched_setaffinity(task, {cpus[1]})
    try:
        yield
    finally:
        for task, mask in before.items():
            with contextlib.suppress(OSError):  # a server thread may have ended
                os.sched_setaffinity(task, mask)


def _timed(call: Callable[[], Any], steps: int) -> list[float]:
    for _ in range(50):
        call()
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return samples


# -- concurrent throughput --------------------------------------------------------------------


async def throughput_floor(url: str, sessions: int, seconds: float) -> float:
    from websockets.asyncio.client import connect

    frame = json.dumps({"type": "step", "data": {"message": MESSAGE}})
    sockets = [
        await connect(url.replace("http", "ws") + "/ws", compression=None) for _ in range(sessions)
    ]

    async def one(ws: Any) -> None:
        await ws.send(frame)
        await ws.recv()

    try:
        return await _drive([lambda ws=ws: one(ws) for ws in sockets], seconds)
    finally:
        for ws in sockets:
            await ws.close()


async def throughput_openenv(url: str, sessions: int, seconds: float) -> float:
    from openenv.core import GenericEnvClient

    clients = [GenericEnvClient(base_url=url) for _ in range(sessions)]
    for client in clients:
        await client.reset()
    try:
        return await _drive([lambda c=c: c.step({"message": MESSAGE}) for c in clients], seconds)
    finally:
        for client in clients:
            await client.close()


async def throughput_ours(url: str, sessions: int, seconds: float) -> float:
    from agile_llmenvs.transport import RemoteEnvClient

    clients = [RemoteEnvClient(url) for _ in range(sessions)]
    for client in clients:
        await client.areset()
    try:
        return await _drive([lambda c=c: c.astep(MESSAGE) for c in clients], seconds)
    finally:
        for client in clients:
            await client.aclose()


async def _drive(calls: list[Callable[[], Awaitable[Any]]], seconds: float) -> float:
    done = 0
    stop = time.perf_counter() + seconds

    async def loop(call: Callable[[], Awaitable[Any]]) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await call()
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(loop(call) for call in calls))
    return done / (time.perf_counter() - start)


def run_throughput(kind: str, url: str, sessions: int, seconds: float) -> float:
    if kind == "ours":  # our clients live on the process-wide session loop
        from agile_llmenvs.transport.session_loop import SESSION_LOOP

        return SESSION_LOOP.run(throughput_ours(url, sessions, seconds))
    from agile_llmenvs._loops import new_event_loop

    runner = throughput_floor if kind == "floor" else throughput_openenv
    with asyncio.Runner(loop_factory=new_event_loop) as loop:  # every side on the same loop
        return loop.run(runner(url, sessions, seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args()

    kinds = ("floor", "openenv", "ours")
    servers = {kind: start_server(kind) for kind in kinds}
    latency_fns = {"floor": latency_floor, "openenv": latency_openenv, "ours": latency_ours}
    latencies: dict[str, list[float]] = {kind: [] for kind in kinds}
    rates: dict[str, dict[int, list[float]]] = {k: {n: [] for n in args.sessions} for k in kinds}
    try:
        for round_index in range(args.rounds):
            for kind in kinds:
                proc, url = servers[kind]
                with pinned(proc.pid):
                    latencies[kind] += latency_fns[kind](url, args.steps)
                for sessions in args.sessions:
                    rates[kind][sessions].append(run_throughput(kind, url, sessions, args.seconds))
            print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for proc, _ in servers.values():
            proc.kill()

    result: dict[str, Any] = {"figure": "remote_env"}
    for kind in kinds:
        samples = sorted(latencies[kind])
        result[kind] = {
            "p50_us": round(statistics.median(samples) * 1e6, 1),
            "p99_us": round(samples[int(0.99 * (len(samples) - 1))] * 1e6, 1),
            **{f"steps_per_s_{n}": round(max(rates[kind][n]), 1) for n in args.sessions},
            **{
                f"steps_per_s_{n}_median": round(statistics.median(rates[kind][n]), 1)
                for n in args.sessions
            },
        }
        print(f"{kind:8s} " + "  ".join(f"{k}={v}" for k, v in result[kind].items()))
    top = max(args.sessions)
    result["ours_p50_over_floor"] = round(result["ours"]["p50_us"] / result["floor"]["p50_us"], 2)
    result["openenv_p50_over_floor"] = round(
        result["openenv"]["p50_us"] / result["floor"]["p50_us"], 2
    )
    result[f"ours_over_openenv_steps_per_s_{top}"] = round(
        result["ours"][f"steps_per_s_{top}"] / result["openenv"][f"steps_per_s_{top}"], 2
    )
    result[f"ours_over_floor_steps_per_s_{top}"] = round(
        result["ours"][f"steps_per_s_{top}"] / result["floor"][f"steps_per_s_{top}"], 2
    )
    result[f"floor_over_openenv_steps_per_s_{top}"] = round(
        result["floor"][f"steps_per_s_{top}"] / result["openenv"][f"steps_per_s_{top}"], 2
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
