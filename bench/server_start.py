"""Env server start: seconds from launch to the first ``GET /health`` 200, against OpenEnv.

Three launches of the same text env, each a fresh process, measured in interleaved rounds
(these machines drift by up to 2x from minute to minute), the median of each kept:

* ``create_app``: ``uvicorn`` serving OpenEnv's own ``create_app`` app (the floor: how an
  OpenEnv env starts today);
* ``serve``: ``agile-llmenvs serve module:Env``, our default WebSocket server;
* ``asgi``: ``uvicorn`` serving our ASGI app (``create_asgi_app``), as a Space's Dockerfile
  would.

The clock starts before the process is spawned and stops at the first 200 from
``/health``, polled every 20 ms: interpreter start, imports, the app's construction and the
bind all count. The last line is JSON: each launch's median and every round's seconds, and
the ratios over ``create_app`` the targets read.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ENV_MODULE = """
class BenchEnv:
    def reset(self, *, seed=None, **task):
        return "ready", {}

    def step(self, action):
        return action, 1.0, False, False, {}

    def close(self):
        pass
"""

APPS_MODULE = """
from bench_env import BenchEnv

def openenv_app():
    from openenv.core.env_server.http_server import create_app

    from agile_llmenvs.transport import OpenEnvWrapper, TextAction, TextObservation

    return create_app(
        lambda: OpenEnvWrapper(BenchEnv(), owns_inner=True),
        TextAction,
        TextObservation,
        max_concurrent_envs=8,
    )

def ours_app():
    from agile_llmenvs.transport import create_asgi_app

    return create_asgi_app(make_env=BenchEnv, max_concurrent_envs=8)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _command(kind: str, port: int) -> list[str]:
    bin_dir = Path(sys.executable).parent
    if kind == "serve":
        cli = bin_dir / "agile-llmenvs"
        return [str(cli), "serve", "bench_env:BenchEnv", "--port", str(port)]
    factory = "bench_apps:openenv_app" if kind == "create_app" else "bench_apps:ours_app"
    return [sys.executable, "-m", "uvicorn", factory, "--factory", "--port", str(port)]


def start_seconds(kind: str, folder: Path, timeout_s: float = 60.0) -> float:
    """Seconds from spawning ``kind``'s server to its first ``/health`` 200."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(folder), "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(
        _command(kind, port),
        cwd=folder,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}/health"
        while time.perf_counter() - start < timeout_s:
            try:
                with urllib.request.urlopen(url, timeout=1) as reply:
                    if reply.status == 200:
                        return time.perf_counter() - start
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"{kind} exited with {proc.returncode} before serving")
            time.sleep(0.02)
        raise TimeoutError(f"{kind} did not answer /health within {timeout_s} s")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    kinds = ("create_app", "serve", "asgi")
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "bench_env.py").write_text(ENV_MODULE)
        (folder / "bench_apps.py").write_text(APPS_MODULE)
        for kind in kinds:  # one unmeasured start each: the page cache, not the server
            start_seconds(kind, folder)
        for round_index in range(args.rounds):
            for kind in kinds[round_index % 3 :] + kinds[: round_index % 3]:
                seconds[kind].append(start_seconds(kind, folder))
                print(f"round {round_index + 1}: {kind} {seconds[kind][-1]:.2f} s", flush=True)
    median = {kind: round(statistics.median(values), 3) for kind, values in seconds.items()}
    result = {
        "rounds": args.rounds,
        "create_app_s": median["create_app"],
        "serve_s": median["serve"],
        "asgi_s": median["asgi"],
        "serve_over_create_app": round(median["serve"] / median["create_app"], 3),
        "asgi_over_create_app": round(median["asgi"] / median["create_app"], 3),
        "seconds": {kind: [round(v, 3) for v in values] for kind, values in seconds.items()},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
