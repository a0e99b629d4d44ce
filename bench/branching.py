"""Branch cost of each strategy against checkpoint depth K and env memory.

An env holds a ledger of K actions (the checkpoint depth) and ``ballast`` MB of touched
memory (10 MB, 500 MB). For each strategy the script times ``manager.branch(name)`` and,
apart, the branch's ``close()``, median over repeats:

- Direct (a pure-step env: the same instance, whatever its size);
- ProcessFork (a fork of the process holding the checkpoint; copy-on-write);
- ActionReplay (a fresh env, reset, K actions replayed).

The target figure, ProcessFork branch cost at 500 MB over 10 MB (within 2x), is measured with
the two checkpoints branched alternately, so both see the same machine load. For reference:
a bare ``os.fork()`` + ``_exit`` + ``waitpid`` of this process holding the same ballast (a
naive fork, 4 KB pages), the checkpoint cost (ProcessFork ships the env to its branch
processes once per checkpoint), and the child processes left after 1,000 branch/release
cycles (the target is zero).

Usage: ``python bench/branching.py [REPEATS]``. Last line: JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
DEPTHS = (1, 16, 64)
MEMORY_MB = (10, 500)
CYCLES = 1000


def at_depth(env: Any, depth: int) -> tuple[Any, tuple[Any, ...]]:
    from agile_llmenvs.core import Action

    state, _ = env.reset(seed=0, options={"start": "s"})
    actions = tuple(Action.from_text(f"a{i}") for i in range(depth))
    for action in actions:
        state = env.step(state, action).next_state
    return state, actions


def branch_cost(manager: Any, repeats: int) -> tuple[float, float]:
    """Median seconds of one branch, and of closing it."""
    branch, close = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        env, _ = manager.branch("k")
        middle = time.perf_counter()
        env.close()
        branch.append(middle - start)
        close.append(time.perf_counter() - middle)
    return statistics.median(branch), statistics.median(close)


def fork_floor(ballast_mb: int, repeats: int) -> float:
    """Median seconds of a bare fork + exit + wait of this process holding the ballast."""
    ballast = bytearray(os.urandom(1)) * (ballast_mb << 20)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        times.append(time.perf_counter() - start)
    del ballast
    return statistics.median(times)


def measure(strategy: str, depth: int, ballast_mb: int, repeats: int) -> dict[str, float]:
    from branch_envs import LedgerEnv, ledger_env

    from agile_llmenvs.branching import BranchManager
    from agile_llmenvs.core import from_text_env

    if strategy == "direct":
        env = from_text_env(lambda: LedgerEnv(ballast_mb), name="ledger", pure_step=True)
    else:
        env = ledger_env(ballast_mb)
    factory = (lambda: ledger_env(ballast_mb)) if strategy == "action_replay" else None
    state, actions = at_depth(env, depth)
    manager = BranchManager.create(env, strategy=strategy, env_factory=factory)  # type: ignore[arg-type]
    try:
        start = time.perf_counter()
        manager.checkpoint("k", state, actions, {"seed": 0, "start": "s"})
        checkpoint_s = time.perf_counter() - start
        if strategy == "action_replay" and ballast_mb > 10:
            repeats = max(3, repeats // 8)  # each branch builds a whole new env
        branch, close = branch_cost(manager, repeats)
    finally:
        manager.close()
        env.close()
    return {"branch_ms": branch * 1e3, "close_ms": close * 1e3, "checkpoint_ms": checkpoint_s * 1e3}


def fork_ratio(repeats: int) -> tuple[float, float, float]:
    """ProcessFork branch cost at 500 MB and 10 MB (ms), branched alternately, and the ratio."""
    from branch_envs import ledger_env

    from agile_llmenvs.branching import BranchManager

    managers, times = {}, {mb: [] for mb in MEMORY_MB}
    for mb in MEMORY_MB:
        env = ledger_env(mb)
        state, _ = at_depth(env, 16)
        managers[mb] = BranchManager.create(env, strategy="process_fork")
        managers[mb].checkpoint("k", state)
    try:
        for _ in range(repeats):
            for mb, manager in managers.items():
                start = time.perf_counter()
                branch_env, _ = manager.branch("k")
                times[mb].append(time.perf_counter() - start)
                branch_env.close()
    finally:
        for manager in managers.values():
            manager.close()
    small, large = (statistics.median(times[mb]) * 1e3 for mb in MEMORY_MB)
    return small, large, large / small


def leftover_children(cycles: int) -> int:
    from branch_envs import children_of, ledger_env

    from agile_llmenvs.branching import BranchManager
    from agile_llmenvs.core import Action

    env = ledger_env()
    state, _ = env.reset(options={"start": "s"})
    with BranchManager.create(env) as manager:
        manager.checkpoint("k", state)
        holder = manager._held["k"].holder  # type: ignore[attr-defined]
        for i in range(cycles):
            branch_env, branch_state = manager.branch("k")
            branch_env.step(branch_state, Action.from_text(str(i)))
            branch_env.close()
        left = len(children_of(holder.pid))
        zygote_pid = manager.strategy._zygote.pid  # type: ignore[attr-defined]
    left += len(children_of(zygote_pid))
    return left


def main() -> None:
    report: dict[str, Any] = {}
    for strategy in ("direct", "process_fork", "action_replay"):
        for ballast_mb in MEMORY_MB:
            for depth in DEPTHS:
                figures = measure(strategy, depth, ballast_mb, REPEATS)
                key = f"{strategy}_k{depth}_{ballast_mb}mb"
                report[key] = {name: round(value, 3) for name, value in figures.items()}
                branch, close = figures["branch_ms"], figures["close_ms"]
                checkpoint = figures["checkpoint_ms"]
                print(
                    f"{key:>28}: branch {branch:9.3f} ms   close {close:7.3f} ms   "
                    f"checkpoint {checkpoint:8.1f} ms",
                    flush=True,
                )
    small, large, ratio = fork_ratio(5 * REPEATS)
    floors = {mb: fork_floor(mb, REPEATS) * 1e3 for mb in MEMORY_MB}
    report["process_fork_branch_ms"] = {"10mb": round(small, 3), "500mb": round(large, 3)}
    report["naive_fork_ms"] = {f"{mb}mb": round(floors[mb], 3) for mb in MEMORY_MB}
    report["fork_500mb_over_10mb"] = round(ratio, 3)
    report["naive_fork_500mb_over_10mb"] = round(floors[500] / floors[10], 3)
    report["children_left_after_1000_cycles"] = leftover_children(CYCLES)
    print(f"ProcessFork branch: {small:.3f} ms at 10 MB, {large:.3f} ms at 500 MB ({ratio:.2f}x)")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
