"""``agile-llmenvs eval CONFIG.yaml``: run an EvalConfig, show progress, print a table.

Every environment of the config runs in one interleaved lock-step loop
(:func:`run_multi_evaluation`), so each step is one backend call across all of them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agile_llmenvs.errors import AgileLLMEnvsError
from agile_llmenvs.evaluation.results import BatchResult

__all__ = ["format_table", "register", "run_eval_command"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``eval`` subcommand to the ``agile-llmenvs`` parser."""
    parser = subparsers.add_parser(
        "eval", help="evaluate a model on the environments of an eval config (YAML)"
    )
    parser.add_argument("config", type=Path, metavar="CONFIG", help="the eval config YAML")
    parser.add_argument(
        "-o", "--output", type=Path, metavar="JSON_PATH", help="also write results as JSON"
    )
    parser.add_argument(
        "--batch-size", type=int, default=None, help="override the config's batch_size"
    )
    parser.set_defaults(run=run_eval_command)


def run_eval_command(args: argparse.Namespace) -> int:
    """Run ``eval``; returns the exit status (1 on a config or setup error)."""
    from agile_llmenvs.config import EvalConfig

    try:
        config = EvalConfig.from_yaml(args.config)
    except ValidationError as exc:
        print(f"error {args.config}: {exc.error_count()} problem(s)", file=sys.stderr)
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"]) or "(config)"
            print(f"  {where}: {error['msg']}", file=sys.stderr)
        return 1
    except AgileLLMEnvsError as exc:
        print(f"error {args.config}: {exc}", file=sys.stderr)
        return 1
    if args.batch_size is not None and args.batch_size < 1:
        print(f"error: --batch-size must be >= 1, got {args.batch_size}", file=sys.stderr)
        return 1
    try:
        results = _evaluate(config, args.batch_size or config.batch_size)
    except AgileLLMEnvsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(format_table(results))
    if args.output is not None:
        payload = {"config": config.model_dump(mode="json"), **_report(results)}
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.output}")
    return 0


def _evaluate(config: Any, batch_size: int | None) -> list[BatchResult]:
    from tqdm import tqdm

    from agile_llmenvs.config import BackendFactory, EnvironmentFactory, create_sampling_params
    from agile_llmenvs.evaluation.multi import MultiEvalEntry, run_multi_evaluation
    from agile_llmenvs.evaluation.runner import RunnerConfig, TrajectoryRunner

    environments = [EnvironmentFactory.create(e) for e in config.environments]
    backend = BackendFactory.create(config.model)
    params = create_sampling_params(config.inference)
    try:
        entries = []
        for env_config, env in zip(config.environments, environments, strict=True):
            runner_config = RunnerConfig(config.system_prompt, max_steps=env_config.max_steps)
            runner = TrajectoryRunner(env, backend, params, config=runner_config)
            tasks = range(min(env_config.size, env.spec.dataset_size or env_config.size))
            entries.append(MultiEvalEntry(runner, tasks))
        total = sum(len(e.task_indices) for e in entries)
        with tqdm(total=total, desc="eval", unit="traj", file=sys.stderr) as bar:
            return run_multi_evaluation(
                entries, batch_size, progress_callback=lambda done, _: bar.update(done - bar.n)
            )
    finally:
        backend.close()
        for env in environments:
            env.close()


def _report(results: Sequence[BatchResult]) -> dict[str, Any]:
    merged = BatchResult.concat(results, "overall")
    return {
        "overall": merged.summary(),
        "environments": [r.to_dict() for r in results],
    }


def format_table(results: Sequence[BatchResult]) -> str:
    """A plain-text table: one row per environment, then the overall row."""
    rows = [r.summary() for r in results]
    if len(results) > 1:
        rows.append(BatchResult.concat(results, "overall").summary())
    header = ("environment", "tasks", "accuracy", "mean reward", "mean steps", "errors")
    cells = [header] + [
        (
            str(row["env_name"]),
            str(row["num_tasks"]),
            f"{row['success_rate']:.1%}",
            f"{row['mean_reward']:.3f}",
            f"{row['mean_steps']:.2f}",
            str(row["num_errors"]),
        )
        for row in rows
    ]
    widths = [max(len(line[col]) for line in cells) for col in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(width) if col == 0 else cell.rjust(width)
            for col, (cell, width) in enumerate(zip(line, widths, strict=True))
        )
        for line in cells
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
