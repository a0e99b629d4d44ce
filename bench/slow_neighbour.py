"""How long one session's slow env call delays another session's steps on the same server.

An env class first proves fast (40 quick steps in session A), then one of its steps takes 1 s.
Meanwhile session B steps as fast as it can; the figure is B's slowest step during that
second, next to B's median step with no slow neighbour (measured in the same run). In the
default ``env_calls="auto"`` the loop waits at most ``inline_wait_s`` (2 ms) for a call
before it serves other sessions, so B's slowest step stays within a few milliseconds; the same
run with ``env_calls="inline"`` (the call on the loop itself) shows what that bound prevents.
Server in this process, loopback, raw ``websockets`` clients. Last line: JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from websockets.sync.client import ClientConnection, connect

from agile_llmenvs.transport import OpenEnvServer, ServerSettings

SLOW_S = 1.0


class SometimesSlowEnv:
    """Echoes each action; the action ``slow`` takes :data:`SLOW_S` seconds."""

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        return "ready", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if action == "slow":
            time.sleep(SLOW_S)
        return action, 0.0, False, False, {}

    def close(self) -> None:
        pass


def ask(ws: ClientConnection, text: str) -> None:
    ws.send(json.dumps({"type": "step", "data": {"message": text}}))
    ws.recv(timeout=30)


def measure(mode: str) -> dict[str, float]:
    settings = ServerSettings(env_calls=mode)  # type: ignore[arg-type]
    with OpenEnvServer(make_env=SometimesSlowEnv, max_concurrent_envs=4, settings=settings) as s:
        url = s.url.replace("http", "ws") + "/ws"
        with connect(url, compression=None) as a, connect(url, compression=None) as b:
            for ws in (a, b):
                ws.send(json.dumps({"type": "reset", "data": {}}))
                ws.recv(timeout=30)
            for _ in range(40):  # the env class proves fast
                ask(a, "x")
            quiet = []
            for _ in range(300):
                start = time.perf_counter()
                ask(b, "y")
                quiet.append(time.perf_counter() - start)
            a.send(json.dumps({"type": "step", "data": {"message": "slow"}}))
            time.sleep(0.01)
            during, end = [], time.perf_counter() + SLOW_S * 0.8
            while time.perf_counter() < end:
                start = time.perf_counter()
                ask(b, "y")
                during.append(time.perf_counter() - start)
            a.recv(timeout=30)
    return {
        "quiet_p50_ms": round(statistics.median(quiet) * 1e3, 3),
        "neighbour_max_ms": round(max(during) * 1e3, 2),
        "steps_during": len(during),
    }


def main() -> None:
    result: dict[str, Any] = {"figure": "slow_neighbour", "slow_call_s": SLOW_S}
    for mode in ("auto", "inline"):
        for key, value in measure(mode).items():
            result[f"{mode}_{key}"] = value
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
