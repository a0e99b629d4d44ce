"""Rollout collection overhead, and adaptive task draws against an O(n) weighted draw.

1. Lock-step collection of 64 groups x 8 (512 slots) of 4-turn in-process episodes with a
   zero-cost scripted policy: the collector's cost per (slot x turn) over the harness's own
   per-turn cost, the same episodes played slot by slot without a collector, interleaved.
2. ``TaskAssigner`` adaptive draws (a sum tree, O(log n)) at 1,000 and 1,000,000 rows against
   ``torch.multinomial`` over all the weights (O(n)), in the same run.

Last line: JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GROUPS, GROUP_SIZE, TURNS = 64, 8, 4


class CountingEnv:
    """A 4-turn text env of 1,000 rows; its observations are ~100 characters."""

    dataset_size = 1000

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        self.row, self.turn = int(task.get("row_index", 0)), 0
        return f"Row {self.row}: count the moves you have made so far, then say the total.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        return (
            f"Turn {self.turn} of row {self.row} is over; keep counting, please.",
            float(self.turn),
            self.turn >= TURNS,
            False,
            {},
        )

    def close(self) -> None:
        pass


def collection(tokenizer: Any, rounds: int) -> dict[str, float]:
    from agile_llmenvs.llm_envs import RolloutCollector, RolloutHarness

    completion = [
        *tokenizer.encode(
            "I have made three moves so far, so the total is three.", add_special_tokens=False
        ),
        tokenizer.eos_token_id,
    ]

    def factory() -> RolloutHarness:
        return RolloutHarness.local(CountingEnv(), tokenizer, max_turns=TURNS)

    collector = RolloutCollector(factory, batch_size=GROUPS, group_size=GROUP_SIZE, base_seed=0)
    slots = GROUPS * GROUP_SIZE
    harnesses = [factory() for _ in range(slots)]
    collector.collect(lambda contexts: [completion] * len(contexts))  # build the slots first
    per_turn_collector, per_turn_harness = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        batch = collector.collect(lambda contexts: [completion] * len(contexts))
        per_turn_collector.append((time.perf_counter() - start) / (slots * TURNS))
        assert len(batch.trajectories) == slots
        start = time.perf_counter()
        for row, harness in enumerate(harnesses):
            harness.reset(seed=row, row_index=row)
            while not harness.step(completion).done:
                pass
            harness.get_episode_data()
        per_turn_harness.append((time.perf_counter() - start) / (slots * TURNS))
    harness_us = statistics.median(per_turn_harness) * 1e6
    collector_us = statistics.median(per_turn_collector) * 1e6
    return {
        "harness_turn_us": round(harness_us, 1),
        "collector_turn_us": round(collector_us, 1),
        "collector_over_harness": round(collector_us / harness_us, 2),
    }


def draws(rows: int, repeats: int) -> dict[str, float]:
    import numpy as np
    import torch

    from agile_llmenvs.llm_envs import TaskAssigner

    assigner = TaskAssigner(rows, seed=0, adaptive=True)
    rng = np.random.default_rng(0)
    for row in rng.integers(0, rows, size=min(rows, 2000)):
        assigner.record_outcome(int(row), [0.0, 1.0])
    weights = torch.from_numpy(assigner.stats.rate + assigner.stats.floor)  # type: ignore[union-attr]
    tree_s, flat_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        assigner.next_task()
        tree_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        torch.multinomial(weights, 1)
        flat_s.append(time.perf_counter() - start)
    tree_us, flat_us = statistics.median(tree_s) * 1e6, statistics.median(flat_s) * 1e6
    return {
        f"draw_{rows}_tree_us": round(tree_us, 2),
        f"draw_{rows}_multinomial_us": round(flat_us, 2),
        f"draw_{rows}_speedup": round(flat_us / tree_us, 1),
    }


def main() -> None:
    from transformers import AutoTokenizer

    from agile_llmenvs.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(f"{tmp}/model"))
    result: dict[str, Any] = {"figure": "collector", "slots": GROUPS * GROUP_SIZE, "turns": TURNS}
    result.update(collection(tokenizer, rounds=5))
    result.update(draws(1_000, repeats=2000))
    result.update(draws(1_000_000, repeats=200))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
