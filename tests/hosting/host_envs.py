"""Text envs for the env-host tests; they run inside Ray actors, which import them by path.

Each env reports where it runs (host index, process, the variables and resources the host
got) in its reset info, so a test can tell which host served which episode.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

HOST_VAR = "AGILE_LLMENVS_ENV_HOST"


class HostEnv:
    """Row ``r`` asks for its number for ``turns`` turns; each right answer pays 1.0.

    Reset info: ``host`` (index), ``pid``, ``environ`` (the ``report_vars`` values), Ray's
    assigned ``resources``, the ``session_ports`` it was given, and what the service on
    ``service_port`` (if any) said. The action ``grow:MB`` holds that many more MiB.
    """

    dataset_size = 8
    max_turns = 2

    def __init__(
        self,
        report_vars: tuple[str, ...] = (),
        service_port: int | None = None,
        session_ports: dict[str, int] | None = None,
    ) -> None:
        self.report_vars = report_vars
        self.service_port = service_port
        self.session_ports = session_ports
        self.ballast: list[bytearray] = []
        self.row = 0
        self.turn = 0

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        import ray

        self.row, self.turn = int(task.get("row_index", 0)), 0
        info = {
            "host": int(os.environ[HOST_VAR]),
            "pid": os.getpid(),
            "environ": {name: os.environ.get(name) for name in self.report_vars},
            "resources": ray.get_runtime_context().get_assigned_resources(),
            "session_ports": self.session_ports,
            "service": _ask(self.service_port) if self.service_port else None,
        }
        return f"Say {self.row}.", info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if action.startswith("grow:"):
            ballast = bytearray(int(action[5:]) * 2**20)
            ballast[::4096] = b"\x01" * len(range(0, len(ballast), 4096))  # make it resident
            self.ballast.append(ballast)
        self.turn += 1
        reward = 1.0 if action.strip() == str(self.row) else 0.0
        return f"Again: say {self.row}.", reward, self.turn >= self.max_turns, False, {}


class SlowStartEnv(HostEnv):
    """A :class:`HostEnv` that takes ``delay_s`` to build on host ``slow_host``."""

    def __init__(self, slow_host: int, delay_s: float) -> None:
        super().__init__()
        if os.environ[HOST_VAR] == str(slow_host):
            time.sleep(delay_s)


class BrokenEnv:
    """An env that cannot be built."""

    def __init__(self) -> None:
        raise RuntimeError("this env needs a GPU sandbox")


def _ask(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as sock:
        return sock.makefile().readline().strip()


def serve(port: int) -> None:
    """A sidecar: answers each connection with its MODE and SERVICE_NAME variables."""
    with socket.create_server(("127.0.0.1", port)) as server:
        while True:
            conn, _ = server.accept()
            with conn:
                reply = f"{os.environ.get('MODE')} {os.environ.get('SERVICE_NAME')}\n"
                conn.sendall(reply.encode())


if __name__ == "__main__":
    serve(int(sys.argv[1]))


def native_env() -> Any:
    """An OpenEnv-native env whose state advertises no turn budget (as ``create_app``'s
    envs do not): hosting it needs ``max_turns`` in the manifest."""
    from agile_llmenvs.transport._openenv import Action, Environment, Observation, State

    class SayAction(Action):
        message: str

    class SayObservation(Observation):
        text: str

    class NativeEnv(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def reset(self, seed: Any = None, episode_id: Any = None, **kwargs: Any) -> Any:
            return SayObservation(text="Say 1.")

        def step(self, action: SayAction, timeout_s: Any = None, **kwargs: Any) -> Any:
            return SayObservation(text="Say 1.", reward=float(action.message == "1"))

        @property
        def state(self) -> State:
            return State()

    return NativeEnv()
