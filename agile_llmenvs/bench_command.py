"""``agile-llmenvs bench``: run the scripts in ``bench/`` and write the performance table.

Each script runs in its own process (one at a time, so they do not compete for the CPU),
with a progress line per script; its last stdout line is its JSON result. A script that
fails, times out or prints no JSON becomes a failed row, and the others still run.

The raw results are kept beside the table (``performance_table.json``), so ``--only`` can
re-measure some scripts and keep the other rows from the previous run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agile_llmenvs.bench_table import ScriptResult, parse_result_line, render_table
from agile_llmenvs.errors import BenchError

__all__ = ["caption", "discover", "register", "run_bench_command", "run_script"]

DEFAULT_OUTPUT = Path("docs/performance_table.md")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bench`` subcommand to the ``agile-llmenvs`` parser."""
    parser = subparsers.add_parser(
        "bench", help="run the scripts in bench/ and write the performance table"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help="run only these scripts (file names, with or without .py); the other rows are "
        "kept from the previous run's results (the table's .json file)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT,
        help=f"Markdown file to write (default {DEFAULT_OUTPUT})",
    )
    parser.add_argument(
        "--bench-dir", type=Path, default=Path("bench"), help="folder of scripts (default bench)"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=1800.0, help="time limit per script (default 1800)"
    )
    parser.set_defaults(run=run_bench_command)


def discover(bench_dir: Path, only: Sequence[str] | None = None) -> list[Path]:
    """The scripts to run, by name: every ``*.py`` not starting with ``_``, or ``only``.

    Raises:
        BenchError: ``bench_dir`` is not a folder, or a name in ``only`` is not a script in it.
    """
    if not bench_dir.is_dir():
        raise BenchError(
            f"no bench folder at {str(bench_dir)!r}: run from the repository root "
            "or pass --bench-dir"
        )
    scripts = {path.stem: path for path in sorted(bench_dir.glob("*.py"))}
    scripts = {name: path for name, path in scripts.items() if not name.startswith("_")}
    if only is None:
        return list(scripts.values())
    wanted = [name.removesuffix(".py") for name in only]
    unknown = [name for name in wanted if name not in scripts]
    if unknown:
        raise BenchError(
            f"no bench script named {', '.join(map(repr, unknown))} in {str(bench_dir)!r}; "
            f"choose from: {', '.join(scripts)}"
        )
    return [scripts[name] for name in dict.fromkeys(wanted)]


def run_script(path: Path, *, timeout_s: float) -> ScriptResult:
    """Run one script with this Python, from the folder above its own, and parse its result."""
    try:
        done = subprocess.run(
            [sys.executable, str(path)],
            cwd=path.resolve().parent.parent,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return ScriptResult(path.name, error=f"timed out after {timeout_s:g} s")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return ScriptResult(path.name, error=f"exit status {done.returncode}: {last}")
    try:
        return ScriptResult(path.name, result=parse_result_line(done.stdout))
    except BenchError as exc:
        return ScriptResult(path.name, error=str(exc))


def caption(today: datetime.date, cpus: int | None, load: float | None) -> str:
    """The line above the table: when and where the figures were measured.

    Args:
        today: The day of the run.
        cpus: CPU cores of the machine.
        load: The machine's 1-minute load average when the run began (other processes
            competing for the cores shift the ratios), if known.
    """
    where = f"{cpus or '?'} CPU cores ({platform.system()}, Python {platform.python_version()})"
    busy = "" if load is None else f", load average {load:.1f} when the run began"
    return f"Measured on {today.isoformat()} on {where}{busy}."


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return None


def run_bench_command(args: argparse.Namespace) -> int:
    """Run ``bench``; returns 0, 1 when a script failed, 2 on a wrong folder or name."""
    try:
        scripts = discover(args.bench_dir, args.only)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    load, results = _load_average(), []
    for index, path in enumerate(scripts, start=1):
        print(f"[{index}/{len(scripts)}] {path.name} ...", end="", flush=True)
        start = time.perf_counter()
        result = run_script(path, timeout_s=args.timeout_s)
        outcome = "ok" if result.error is None else f"failed: {result.error}"
        print(f" {time.perf_counter() - start:.1f} s, {outcome}", flush=True)
        results.append(result)
    measured = caption(datetime.date.today(), os.cpu_count(), load)
    store = args.output.with_suffix(".json")
    runs = _previous_runs(store) if args.only else {}
    runs.update(
        {r.script: {"result": r.result, "error": r.error, "caption": measured} for r in results}
    )
    ran = {result.script for result in results}
    kept = sorted(name for name in runs if name not in ran)
    text = render_table(
        [ScriptResult(name, runs[name]["result"], runs[name]["error"]) for name in sorted(runs)],
        caption=measured + _kept_note(kept, runs),
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    store.write_text(json.dumps(runs, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {args.output}")
    return 0 if all(result.error is None for result in results) else 1


def _previous_runs(store: Path) -> dict[str, dict[str, Any]]:
    """The results of the last run, by script name (none when there is no readable file)."""
    try:
        runs = json.loads(store.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return runs if isinstance(runs, dict) else {}


def _kept_note(kept: list[str], runs: dict[str, dict[str, Any]]) -> str:
    """The caption's addition naming rows kept from an earlier run, and when that was."""
    if not kept:
        return ""
    names = ", ".join(f"`bench/{name}`" for name in kept)
    when = "; ".join(sorted({str(runs[name]["caption"]).removesuffix(".") for name in kept}))
    return f" Rows of {names} are kept from an earlier run ({when})."
