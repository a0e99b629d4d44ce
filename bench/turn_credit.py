"""What turn-level credit saves: tokens and time for GRPO to learn a multi-turn task, per mode.

Two tasks, on the built-in tiny model: the corridor (``manifests/grpo_corridor.yaml``: only
the first of its turns decides the reward) and every-turn (``manifests/grpo_every_turn.yaml``:
a digit at each of 4 turns, rewarded only if every turn said one). Each is trained with
``training.credit`` set to ``episode`` (plain GRPO), ``turn_mc``, ``anchor`` and ``tree`` at
the manifest's settings, and ``tree_leaves`` (``MODE_SETTINGS``: ``tree`` at equal leaves a
group, Tree-GRPO's comparison), for ``SEEDS`` seeds each, every run a fresh process into a
temporary folder, stopped once it has learnt the task or at ``--max-steps``. From each run's
``metrics.csv`` it finds the first step at which the mean of ``reward_mean`` over the
last ``WINDOW`` steps reaches ``THRESHOLD``, and counts up to that step:

* tokens: everything the policy sampled, ``policy_tokens`` (the training episodes) plus
  ``credit_tokens`` (the continuations ``turn_mc`` and ``tree`` branch);
* wall seconds: the sum of ``step_time_s`` (the whole step, credit rollouts included;
  setup excluded).

A run that never reaches the threshold counts as its totals at the step cap, and is flagged
(``reached: false``). Reports per task and mode the median over seeds (the corridor's at the
top level, every-turn's under ``every_turn``), and for each task:

* ``episode_over_best_tokens``: episode credit's tokens over the best of ``tree``,
  ``tree_leaves`` and ``turn_mc`` (and ``turn_mc_leaves`` when run; target >= 1.5 on at least
  two tasks);
* ``anchor_over_tree_tokens`` and ``anchor_over_tree_leaves_tokens``: ``anchor``'s tokens over
  ``tree``'s (``tree`` ahead: > 1); ``episode_over_tree_leaves_tokens``;
* for reference: ``episode_over_turn_mc_tokens``, ``episode_over_tree_tokens``,
  ``episode_over_anchor_tokens``, ``episode_over_turn_mc_wall``.

A third task is opt-in (``--tasks textworld``, or ``--tasks corridor every_turn textworld``):
TextWorld quest games (``manifests/grpo_textworld.yaml``: a real outside env, the quest's score
as reward, commands answered by number), with its own threshold (``THRESHOLDS``). It is left
out of a plain run because the built-in tiny model does not learn it within the step cap:
its observations run to hundreds of tokens a turn, so a step costs seconds, and a random
policy wins about one game in 150 (docs/performance.md, "Turn-level credit").

``--quick``: one seed, a smoke run. ``--modes`` / ``--tasks``: only some (ratios need both
sides). Last line: JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MANIFESTS = Path(__file__).resolve().parents[1] / "manifests"
TASKS = {
    "corridor": MANIFESTS / "grpo_corridor.yaml",
    "every_turn": MANIFESTS / "grpo_every_turn.yaml",
    "textworld": MANIFESTS / "grpo_textworld.yaml",
}
#: What a plain run measures; ``--tasks textworld`` adds TextWorld (see the docstring).
DEFAULT_TASKS = ("corridor", "every_turn")
#: What a mode sets in the task's manifest. ``tree_leaves`` is Tree-GRPO's own comparison, at
#: equal leaves a group: ``tree`` on groups of 2 episodes, each branching one continuation
#: before each later turn, so a group of these 4-turn tasks has 2 x (1 + 3) = 8 leaves, as a
#: manifest group of 8 episodes has; the prefixes they share are sampled once. The others are
#: opt-in controls at the same group size (``--modes episode_g2 anchor_g2 turn_mc_leaves``;
#: docs/performance.md): they tell the smaller group's share of ``tree_leaves``' saving from
#: the branches'.
_LEAVES = {"group_size": 2, "credit_rollouts": 1, "credit_turns": "all"}
MODE_SETTINGS: dict[str, dict[str, Any]] = {
    "tree_leaves": {"credit": "tree", **_LEAVES},
    "episode_g2": {"credit": "episode", "group_size": 2},
    "anchor_g2": {"credit": "anchor", "group_size": 2},
    "turn_mc_leaves": {"credit": "turn_mc", **_LEAVES},
}
DEFAULT_MODES = ("episode", "turn_mc", "anchor", "tree", "tree_leaves")
MODES = tuple(dict.fromkeys((*DEFAULT_MODES, *MODE_SETTINGS)))
SEEDS = (0, 1, 2)
MAX_STEPS = 250
THRESHOLD = 0.9
#: A task's own threshold where 0.9 is out of the tiny model's reach in the step cap.
THRESHOLDS = {"textworld": 0.5}
WINDOW = 5
POLL_S = 0.5

# One run, in a process of its own; it writes metrics.csv row by row into the given folder.
_RUN = """
import json, sys
from agile_llmenvs.specs import load_manifest
from agile_llmenvs.training import train_grpo

manifest_path, output_dir, settings, seed, max_steps = sys.argv[1:6]
manifest = load_manifest(manifest_path)
update = {**json.loads(settings), "max_steps": int(max_steps), "output_dir": output_dir,
          "tensorboard": False}
training = manifest.training.model_copy(update=update)
train_grpo(manifest.model_copy(update={"training": training, "seed": int(seed)}))
"""


@dataclass(frozen=True)
class Learnt:
    """How much one run spent until it learnt the task (or until its step cap)."""

    credit: str
    seed: int
    reached: bool
    step: int
    tokens: float
    policy_tokens: float
    credit_tokens: float
    wall_s: float
    credit_time_s: float


def _column(row: dict[str, str], key: str) -> float:
    value = row.get(key, "")
    return float(value) if value else 0.0


def _policy_tokens(row: dict[str, str]) -> float:
    """``policy_tokens``; from a run that predates the column, the training batch's sampled
    tokens (``tokens_per_s`` x ``step_time_s``), which it equals for episode credit."""
    if "policy_tokens" in row:
        return _column(row, "policy_tokens")
    return round(_column(row, "tokens_per_s") * _column(row, "step_time_s"))


def learnt_at(rows: list[dict[str, str]], *, threshold: float, window: int) -> tuple[int, bool]:
    """The number of steps until the mean ``reward_mean`` of the last ``window`` steps first
    reaches ``threshold``, and whether it did (else: all the rows)."""
    rewards = [_column(row, "reward_mean") for row in rows]
    for end in range(window, len(rewards) + 1):
        if sum(rewards[end - window : end]) / window >= threshold:
            return end, True
    return len(rows), False


def _read_rows(path: Path) -> list[dict[str, str]]:
    """The finished rows of a metrics CSV a run may be writing (not a line cut mid-write)."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    complete = [line for line in lines if line.endswith("\n")]
    return list(csv.DictReader(complete))


def threshold_of(task: str) -> float:
    """The mean reward ``task`` counts as learnt at."""
    return THRESHOLDS.get(task, THRESHOLD)


def run_once(credit: str, seed: int, max_steps: int, task: str = "corridor") -> Learnt:
    """Train ``task`` with ``credit`` until it is learnt or ``max_steps``; what it cost."""
    threshold = threshold_of(task)
    with tempfile.TemporaryDirectory(prefix=f"turn-credit-{credit}-") as folder:
        metrics, log = Path(folder) / "metrics.csv", Path(folder) / "stderr.log"
        settings = json.dumps(MODE_SETTINGS.get(credit, {"credit": credit}))
        command = [sys.executable, "-c", _RUN, str(TASKS[task]), folder, settings, str(seed)]
        with log.open("w") as stderr:
            process = subprocess.Popen(
                [*command, str(max_steps)], stdout=subprocess.DEVNULL, stderr=stderr
            )
            while process.poll() is None:
                if learnt_at(_read_rows(metrics), threshold=threshold, window=WINDOW)[1]:
                    process.kill()  # learnt: the rest of the run is not measured
                    break
                time.sleep(POLL_S)
            process.wait()
        rows = _read_rows(metrics)
        if process.returncode not in (0, -9) or not rows:
            message = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the {task} {credit} run (seed {seed}) failed: {message}")
    steps, reached = learnt_at(rows, threshold=threshold, window=WINDOW)
    counted = rows[:steps]
    policy = sum(_policy_tokens(row) for row in counted)
    extra = sum(_column(row, "credit_tokens") for row in counted)
    return Learnt(
        credit=credit,
        seed=seed,
        reached=reached,
        step=steps,
        tokens=policy + extra,
        policy_tokens=policy,
        credit_tokens=extra,
        wall_s=round(sum(_column(row, "step_time_s") for row in counted), 2),
        credit_time_s=round(sum(_column(row, "credit_time_s") for row in counted), 2),
    )


def summarise(runs: list[Learnt]) -> dict[str, Any]:
    """Medians over seeds per mode, and every run that did not reach the threshold."""
    report: dict[str, Any] = {}
    for credit in dict.fromkeys(run.credit for run in runs):
        mine = [run for run in runs if run.credit == credit]
        report[credit] = {
            "steps": statistics.median(run.step for run in mine),
            "tokens": statistics.median(run.tokens for run in mine),
            "credit_tokens": statistics.median(run.credit_tokens for run in mine),
            "wall_s": round(statistics.median(run.wall_s for run in mine), 2),
            "all_reached": all(run.reached for run in mine),
        }
    return report


def _ratio(report: dict[str, Any], over: str, under: str, key: str) -> float | None:
    if over not in report or under not in report or not report[under][key]:
        return None
    return round(report[over][key] / report[under][key], 3)


def _task_report(runs: list[Learnt]) -> dict[str, Any]:
    """One task's medians per mode and its ratios."""
    medians = summarise(runs)
    branched = ("tree", "tree_leaves", "turn_mc", "turn_mc_leaves")
    turn_level = [mode for mode in branched if mode in medians]
    best = min(turn_level, key=lambda mode: medians[mode]["tokens"], default=None)
    return {
        **medians,
        "best_turn_level": best,
        "episode_over_best_tokens": _ratio(medians, "episode", best, "tokens") if best else None,
        "anchor_over_tree_tokens": _ratio(medians, "anchor", "tree", "tokens"),
        "anchor_over_tree_leaves_tokens": _ratio(medians, "anchor", "tree_leaves", "tokens"),
        "episode_over_tree_leaves_tokens": _ratio(medians, "episode", "tree_leaves", "tokens"),
        "episode_over_tree_tokens": _ratio(medians, "episode", "tree", "tokens"),
        "episode_over_turn_mc_tokens": _ratio(medians, "episode", "turn_mc", "tokens"),
        "episode_over_turn_mc_wall": _ratio(medians, "episode", "turn_mc", "wall_s"),
        "episode_over_anchor_tokens": _ratio(medians, "episode", "anchor", "tokens"),
        "runs": len(runs),
        "not_reached": sum(not run.reached for run in runs),
        "runs_not_reached": [f"{run.credit}/{run.seed}" for run in runs if not run.reached],
    }


def measure(
    modes: list[str], seeds: list[int], max_steps: int, tasks: list[str] | None = None
) -> dict[str, Any]:
    reports: dict[str, dict[str, Any]] = {}
    for task in tasks or list(DEFAULT_TASKS):
        runs: list[Learnt] = []
        for credit in modes:
            for seed in seeds:
                runs.append(run_once(credit, seed, max_steps, task))
                print(json.dumps({"task": task, **asdict(runs[-1])}), flush=True)
        reports[task] = {**_task_report(runs), "threshold": threshold_of(task)}
    corridor = reports.pop("corridor", {})
    return {
        "figure": "turn_credit",
        "seeds": len(seeds),
        "max_steps": max_steps,
        "threshold": THRESHOLD,
        "window": WINDOW,
        **corridor,  # the corridor's at the top level, as before
        **reports,
        "tasks_meeting_target": sum(
            (report.get("episode_over_best_tokens") or 0) >= 1.5
            for report in [corridor, *reports.values()]
            if report
        ),
        "load_avg_1m": os.getloadavg()[0],  # at the end; other processes swamp these
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one seed: a smoke run")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES))
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(DEFAULT_TASKS))
    parser.add_argument("--max-steps", type=int, default=MAX_STEPS, help="step cap per run")
    args = parser.parse_args()
    seeds = list(SEEDS[:1] if args.quick else SEEDS)
    print(json.dumps(measure(args.modes, seeds, args.max_steps, args.tasks)))


if __name__ == "__main__":
    main()
