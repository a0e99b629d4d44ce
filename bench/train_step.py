"""Where a GRPO step's time goes on the tiny model: generation, env/harness, learning.

Runs the quick start's settings (8 groups x 8, 8 new tokens) for ``STEPS`` steps into a
temporary folder and reports the median of each timing column of ``metrics.csv`` over the
steps after the first (warm-up), and ``overhead_ratio``: the median over those steps of the
share of the step that is neither the backend's generate calls nor the forward, backward and
optimizer step (envs, harness, collector, advantages, batch building). Target: <= 0.05 (#45).

The same run then trains again with the collector's ``reset`` and ``step`` cut to the floor
of the quick start's one-turn rubric env (:func:`floor_path`): the env's own ``reset`` and
``step``, the template's prompt ids, the decode, and the episode's record, with none of the
slots, the harness's turn logic or the client between them. ``floor_overhead_ratio`` is that
run's share: what a path with no cost of its own would reach in the same loop (reference).
Last line: JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
KEYS = ("step_time_s", "gen_time_s", "env_time_s", "learn_time_s", "tokens_per_s")
MANIFEST = Path(__file__).resolve().parents[1] / "manifests" / "quickstart.yaml"
TARGET = 0.05


def train(manifest: Any) -> tuple[list[dict[str, float]], float]:
    """``STEPS`` steps of ``manifest`` in a temporary folder: the rows after the first, and
    the wall time."""
    from agile_llmenvs.training import train_grpo

    with tempfile.TemporaryDirectory() as output_dir:
        training = manifest.training.model_copy(
            update={"max_steps": STEPS, "output_dir": output_dir, "tensorboard": False}
        )
        start = time.perf_counter()
        result = train_grpo(manifest.model_copy(update={"training": training}))
        wall = time.perf_counter() - start
    return result.metrics[1:], wall


def overhead(rows: Sequence[dict[str, float]]) -> float:
    """The median share of a step that is neither generation nor learning."""
    return statistics.median(
        (row["step_time_s"] - row["gen_time_s"] - row["learn_time_s"]) / row["step_time_s"]
        for row in rows
    )


@contextmanager
def floor_path() -> Iterator[None]:
    """The lock-step collector's ``reset`` and ``step`` cut to what any path must do for a
    one-turn text env in this process: the env's own calls, the prompt's ids (the template's,
    memoised), the completion's text, and the episode's record. No error handling, no
    limits: a floor to measure against, not a path to train with."""
    from agile_llmenvs.core import StopReason, TurnResult
    from agile_llmenvs.llm_envs.collector import RolloutCollector
    from agile_llmenvs.llm_envs.episode_state import EpisodeState

    def reset(self: RolloutCollector) -> list[list[int]]:
        assigner = self.assigner
        self._tasks = [assigner.next_task() for _ in range(self.groups)]
        prompts = []
        for index in range(self.num_slots):
            self.slots[index].failure = None
            harness = self.slots.harness(index)
            task = self._tasks[index // self.group_size]
            env = harness.client.env.inner  # the quick start's RubricEnv, in this process
            prompt, info = env.reset(seed=task.seed, row_index=task.row_index)
            episode = harness._episode = EpisodeState(info=info)
            episode.messages = [{"role": "user", "content": prompt}]
            ids = harness.framer.prompt(episode.messages)
            episode.append(ids, turn=None)
            prompts.append(ids)
        return prompts

    def step(
        self: RolloutCollector,
        completions: dict[int, Sequence[int]],
        sampling_logps: dict[int, Sequence[float]] | None = None,
    ) -> dict[int, TurnResult]:
        results = {}
        for index, ids in completions.items():
            harness = self.slots.harness(index)
            episode = harness._episode
            assert episode is not None
            episode.append(ids, turn=0)
            episode.logps.extend((sampling_logps or {})[index])
            env = harness.client.env.inner
            _, reward, _, _, info = env.step(harness.framer.decode(ids))
            episode.rewards.append(reward)
            episode.info.update(info)
            episode.stop_reason = StopReason.TERMINATED
            episode.close_sample()
            results[index] = TurnResult([], reward, True, info)
        return results

    saved = RolloutCollector.reset, RolloutCollector.step
    RolloutCollector.reset, RolloutCollector.step = reset, step  # type: ignore[method-assign]
    try:
        yield
    finally:
        RolloutCollector.reset, RolloutCollector.step = saved  # type: ignore[method-assign]


def main() -> None:
    from agile_llmenvs.specs import load_manifest

    manifest = load_manifest(MANIFEST)
    assert manifest.training is not None
    assert manifest.env.max_turns == 1  # the floor plays one-turn episodes
    rows, wall = train(manifest)
    with floor_path():
        floor_rows, floor_wall = train(manifest)
    report = {key: statistics.median(row[key] for row in rows) for key in KEYS}
    report.update(overhead_ratio=overhead(rows), target=TARGET)
    report.update(
        floor_overhead_ratio=overhead(floor_rows),
        floor_env_time_s=statistics.median(row["env_time_s"] for row in floor_rows),
        floor_step_time_s=statistics.median(row["step_time_s"] for row in floor_rows),
    )
    # other processes on the cores make torch's threads stall and swamp every other figure
    report.update(steps=STEPS, wall_s=wall + floor_wall, load_avg_1m=os.getloadavg()[0])
    for key, value in report.items():
        print(f"{key:>20}: {value:.4g}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
