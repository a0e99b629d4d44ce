"""Text envs for the branching and from-state tests, importable by branch processes.

They live in a module on the test path (not in a test file) so that the branch processes,
which unpickle them, can import them by name.
"""

from __future__ import annotations

import os
import pickle
import random
import struct
import subprocess
import threading
from pathlib import Path
from typing import Any

from agile_llmenvs.core import EnvironmentSpec, State, from_text_env
from agile_llmenvs.core.text_env import TextEnvironment


class LedgerEnv:
    """Keeps every action in its own memory; the observation is the ledger so far.

    Each step pays the ledger's length; ``"stop"`` terminates. ``ballast_mb`` megabytes of
    touched memory make the env as big as a real simulator, for the fork benchmarks.
    """

    def __init__(self, ballast_mb: int = 0) -> None:
        self.ledger: list[str] = []
        self.ballast = bytearray(os.urandom(1)) * (ballast_mb << 20)

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        start = str(task.get("start", "start"))
        self.ledger = [start]
        return self.render(), {"seed": seed}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.ledger.append(action)
        return self.render(), float(len(self.ledger)), action == "stop", False, {"pid": os.getpid()}

    def render(self) -> str:
        return "|".join(self.ledger)

    def close(self) -> None:
        self.ledger = []


def ledger_env(ballast_mb: int = 0) -> TextEnvironment:
    """A non-pure, forkable Environment over one LedgerEnv per episode."""
    return from_text_env(lambda: LedgerEnv(ballast_mb), name="ledger")


class LockedLedgerEnv(LedgerEnv):
    """A LedgerEnv holding a lock: it does not pickle."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()


class ShellLedgerEnv(LedgerEnv):
    """A LedgerEnv that runs what a hostile policy could make an env run.

    ``fds`` runs a shell (passing every inheritable descriptor, as ``os.system`` or a pty
    would) that lists the descriptors it holds, as the observation; ``forge:PATH`` writes a
    framed pickle that would run ``touch PATH`` to every socket this process holds (its
    branch socket), then steps as usual.
    """

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if action == "fds":
            shell = ["bash", "-c", "ls -l /proc/self/fd"]
            listing = subprocess.run(shell, capture_output=True, text=True, close_fds=False)
            return listing.stdout, 0.0, False, False, {}
        if action.startswith("forge:"):
            forged = pickle.dumps(("ok", TouchOnLoad(action.split(":", 1)[1])))
            for fd in _socket_fds():
                os.write(fd, struct.pack("!Q", len(forged)) + forged)
        return super().step(action)


class TouchOnLoad:
    """Unpickling it runs ``touch PATH``: what an attacker writes to a control socket."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.path}",)


def _socket_fds() -> list[int]:
    fds = []
    for entry in Path("/proc/self/fd").iterdir():
        try:
            if os.readlink(entry).startswith("socket:"):
                fds.append(int(entry.name))
        except OSError:
            continue
    return fds


def shell_ledger_env() -> TextEnvironment:
    """A forkable Environment over one ShellLedgerEnv per episode."""
    return from_text_env(ShellLedgerEnv, name="shell-ledger")


class MarkedEnvironment(TextEnvironment):
    """A TextEnvironment whose spec says it is not forkable (as an env with a shell would)."""

    @property
    def spec(self) -> EnvironmentSpec:
        return EnvironmentSpec(name="marked", forkable=False)


def marked_env() -> MarkedEnvironment:
    return MarkedEnvironment(LedgerEnv, name="marked")


#: The outcome table of DiceEnv: action -> [(probability, reward, terminates)].
DICE_OUTCOMES: dict[str, list[tuple[float, float, bool]]] = {
    "risky": [(0.5, 2.0, False), (0.5, 0.0, True)],
    "safe": [(1.0, 0.25, True)],
    "other": [(0.25, 1.0, False), (0.25, 0.0, False), (0.5, 0.0, True)],
}


class DiceEnv:
    """A stochastic env: each step draws its outcome from ``DICE_OUTCOMES`` with the
    process-wide ``random`` module (which CPython reseeds in every forked child). Actions
    other than ``risky`` and ``safe`` count as ``other``; at most ``max_turns`` steps.
    """

    max_turns = 3

    def __init__(self) -> None:
        self.turn = 0

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        self.turn = 0
        return "Pick risky or safe.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        kind = action if action in DICE_OUTCOMES else "other"
        draw, total = random.random(), 0.0
        for probability, reward, terminates in DICE_OUTCOMES[kind]:  # noqa: B007 (the drawn one)
            total += probability
            if draw < total:
                break
        done = terminates or self.turn >= self.max_turns
        return f"Turn {self.turn}: you got {reward}.", reward, done, False, {}

    def close(self) -> None:
        pass


def dice_value(kind: str, turns_left: int) -> float:
    """The exact expected return of taking ``kind`` and then ``other`` until the end."""
    value = 0.0
    for probability, reward, terminates in DICE_OUTCOMES[kind]:
        future = 0.0 if terminates or turns_left == 1 else dice_value("other", turns_left - 1)
        value += probability * (reward + future)
    return value


def live_pids(pids: list[int]) -> list[int]:
    """The pids of ``pids`` that still exist (zombies included: they were not reaped)."""
    return [pid for pid in pids if Path(f"/proc/{pid}").exists()]


def children_of(pid: int) -> list[int]:
    """The pids whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


__all__ = [
    "DICE_OUTCOMES",
    "DiceEnv",
    "LedgerEnv",
    "LockedLedgerEnv",
    "MarkedEnvironment",
    "ShellLedgerEnv",
    "State",
    "TouchOnLoad",
    "children_of",
    "dice_value",
    "ledger_env",
    "live_pids",
    "marked_env",
    "shell_ledger_env",
]


class DoorEnv:
    """Three turns, deterministic: turn 1's action decides the last reward, turn 2's pays a
    bonus now (the turn-credit tests derive their values by hand from these rules).

    * turn 1 (in the ``cell``): ``a`` takes the key; the next observation is ``hall`` either way;
    * turn 2 (at ``hall``): ``b`` pays 0.5; next ``door``;
    * turn 3 (at ``door``): pays 1.0 with the key, else 0, and terminates.
    """

    pure_step = True
    max_turns = 3

    def __init__(self) -> None:
        self.turn, self.key = 0, False

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        self.turn, self.key = 0, False
        return "cell", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        if self.turn == 1:
            self.key = action.strip() == "a"
            return "hall", 0.0, False, False, {}
        if self.turn == 2:
            return "door", 0.5 if action.strip() == "b" else 0.0, False, False, {}
        return "", 1.0 if self.key else 0.0, True, False, {}

    def close(self) -> None:
        pass


class ForkedDoorEnv(DoorEnv):
    """A DoorEnv that does not declare ``pure_step``: ``auto`` branches it by ProcessFork."""

    pure_step = False


class UnforkableDoorEnv(DoorEnv):
    """A DoorEnv that says it cannot be forked (it stands for one holding a shell)."""

    pure_step = False
    forkable = False


class SerialDoorEnv(DoorEnv):
    """A DoorEnv whose observations show the instance's serial number: a replay on a fresh
    instance never reaches the recorded state (an env not deterministic given its seed)."""

    pure_step = False
    made = 0

    def __init__(self) -> None:
        super().__init__()
        SerialDoorEnv.made += 1
        self.serial = SerialDoorEnv.made

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        observation, *rest = super().step(action)
        if observation:
            observation = f"{observation} {self.serial}"
        return (observation, *rest)  # type: ignore[return-value]


def door_manifest(
    model_dir: Path,
    output_dir: Path,
    env: str = "DoorEnv",
    model: dict[str, Any] | None = None,
    **training: Any,
) -> Any:
    """A GRPO manifest of 2 steps of 2 groups of 2 on one of the door envs above (a
    ``RunManifest``), with ``training`` fields added or overridden."""
    from agile_llmenvs.specs import RunManifest

    return RunManifest.model_validate(
        {
            "name": "door",
            "env": {"env_type": "rollout", "entrypoint": f"branch_envs:{env}", "max_turns": 3},
            "model": {"path": str(model_dir), **(model or {})},
            "training": {
                "algorithm": "grpo",
                "max_steps": 2,
                "batch_size": 2,
                "group_size": 2,
                "max_new_tokens": 4,
                "log_rollouts_every": 0,
                "tensorboard": False,
                "output_dir": str(output_dir),
                **training,
            },
            "seed": 0,
        }
    )
