"""``agile-llmenvs show RUN``: write a run's logged episodes as one self-contained HTML page."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path

from agile_llmenvs._run_files import ROLLOUTS_PAGE
from agile_llmenvs.viewer.page import RunPage, render_page
from agile_llmenvs.viewer.records import (
    METRICS_FILE,
    ROLLOUTS_FILE,
    RolloutLogError,
    read_reward_curve,
    read_rollouts,
    select_steps,
)

__all__ = ["parse_limit", "parse_steps", "register", "run_show_command", "write_page"]

_DEFAULT_LIMIT = 10


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``show`` subcommand to the ``agile-llmenvs`` parser."""
    parser = subparsers.add_parser(
        "show", help="write a run's logged episodes as an HTML page (RUN/rollouts.html)"
    )
    parser.add_argument(
        "run_dir", type=Path, metavar="RUN", help="a run folder (a GRPO run's output_dir)"
    )
    parser.add_argument(
        "-o", "--output", type=Path, metavar="HTML_PATH", help="default: RUN/rollouts.html"
    )
    parser.add_argument(
        "--steps",
        type=parse_steps,
        metavar="STEPS",
        help="steps to show: numbers and ranges, e.g. 10,50-100 (default: all logged)",
    )
    parser.add_argument(
        "--limit",
        type=parse_limit,
        default=_DEFAULT_LIMIT,
        metavar="N",
        help=f"show at most N of those steps, spread from first to last (default "
        f"{_DEFAULT_LIMIT}; 0: all)",
    )
    parser.set_defaults(run=run_show_command)


def run_show_command(args: argparse.Namespace) -> int:
    """Run ``show``; returns the exit status (a missing log raises :class:`RolloutLogError`,
    which the command line prints in one line and exits 2)."""
    output = args.output or args.run_dir / ROLLOUTS_PAGE
    shown = write_page(args.run_dir, output, steps=args.steps, limit=args.limit)
    print(f"wrote {output}: {shown} episodes")
    return 0


def write_page(
    run_dir: Path,
    output: Path,
    *,
    steps: Sequence[range] | None = None,
    limit: int = _DEFAULT_LIMIT,
) -> int:
    """Write the page of ``run_dir``'s logged episodes to ``output``.

    Args:
        run_dir: A run folder holding ``rollouts.jsonl`` (and ``metrics.csv``, for the curve).
        output: The HTML file to write.
        steps: Ranges of the steps to show (None: every logged one).
        limit: At most this many steps, spread evenly over those (0: all).

    Returns:
        The number of episodes on the page.

    Raises:
        RolloutLogError: ``run_dir`` has no logged episodes, or none of ``steps``.
    """
    if not run_dir.is_dir():
        raise RolloutLogError(f"{run_dir} is not a folder; pass a run's output_dir")
    episodes = read_rollouts(run_dir / ROLLOUTS_FILE)
    logged = sorted({episode.step for episode in episodes})
    chosen = set(select_steps(logged, steps, limit))
    if not chosen:
        raise RolloutLogError(
            f"{run_dir / ROLLOUTS_FILE} has no episodes of the steps asked for; it has steps "
            f"{logged[0]}-{logged[-1]} ({len(logged)} logged)"
        )
    shown = [episode for episode in episodes if episode.step in chosen]
    shown.sort(key=lambda episode: episode.step)  # stable: file order within a step
    metrics = run_dir / METRICS_FILE
    page = RunPage(
        title=run_dir.resolve().name,
        episodes=shown,
        logged_steps=logged,
        curve=read_reward_curve(metrics),
        sources=[ROLLOUTS_FILE] + ([METRICS_FILE] if metrics.is_file() else []),
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(render_page(page), encoding="utf-8")
    return len(shown)


_STEP_PART = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_steps(text: str) -> list[range]:
    """``"10,50-100"`` as the ranges of steps it names (a range includes both ends).

    Raises:
        argparse.ArgumentTypeError: a part is neither a step nor a ``first-last`` range.
    """
    steps: list[range] = []
    for part in text.split(","):
        match = _STEP_PART.match(part.strip())
        if match is None:
            raise argparse.ArgumentTypeError(
                f"expected steps and ranges such as 10,50-100, got {part.strip()!r}"
            )
        first = int(match.group(1))
        last = int(match.group(2) or first)
        if last < first:
            raise argparse.ArgumentTypeError(f"the range {part.strip()!r} ends before it starts")
        steps.append(range(first, last + 1))
    return steps


def parse_limit(text: str) -> int:
    """``--limit``: a count of steps, 0 for all.

    Raises:
        argparse.ArgumentTypeError: not a whole number of at least 0.
    """
    try:
        limit = int(text)
    except ValueError:
        limit = -1
    if limit < 0:
        raise argparse.ArgumentTypeError(f"expected a number of steps (0: all), got {text!r}")
    return limit
