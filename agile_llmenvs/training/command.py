"""``agile-llmenvs train MANIFEST [--resume | --overwrite]``: run the manifest's training
algorithm, quietly, and end with one line that sums the run up."""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from agile_llmenvs.errors import AgileLLMEnvsError

if TYPE_CHECKING:  # the command line imports this module; torch only when it trains
    from agile_llmenvs.training.run import RunSettings, TrainResult

__all__ = ["evaluate_hint", "register", "run_train_command", "stop_status", "summary_line"]

# The metric a run's summary averages over its last tenth of steps, and its label.
_SUMMARY_METRIC = {"grpo": ("reward_mean", "mean reward"), "sft": ("loss", "mean loss")}
_SUMMARY_METRIC["dpo"] = _SUMMARY_METRIC["sft"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``train`` subcommand to the ``agile-llmenvs`` parser."""
    parser = subparsers.add_parser(
        "train", help="train the manifest's model with its algorithm (grpo, sft or dpo)"
    )
    parser.add_argument("manifest", type=Path, metavar="MANIFEST", help="a run manifest")
    start = parser.add_mutually_exclusive_group()
    start.add_argument(
        "--resume", action="store_true", help="continue the run in output_dir from its checkpoint"
    )
    start.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run in output_dir (its metrics, checkpoints, plot and manifest)",
    )
    parser.set_defaults(run=run_train_command)


def run_train_command(args: argparse.Namespace) -> int:
    """Run ``train``; returns the exit status (2 on a manifest or setup error; 130 or 143 for
    a run SIGINT or SIGTERM stopped, see :func:`stop_status`).

    An error of the run itself (a folder that holds a run, a resume that does not match)
    goes up to the command line, which prints it in one line and exits 2. Other libraries'
    progress bars and logs below errors are off unless ``--debug``.
    """
    from agile_llmenvs.training import train_dpo, train_grpo, train_sft
    from agile_llmenvs.training.run import RunSettings, quiet_libraries
    from agile_llmenvs.validation import problem_lines, validate_file

    started = time.monotonic()
    with nullcontext() if getattr(args, "debug", False) else quiet_libraries():
        # validate's checks and words first (the env is built once, by the run's own setup)
        checked = validate_file(args.manifest, build=False)
        if checked.kind != "run manifest":
            print(f"error {args.manifest}: an eval config, not a run manifest", file=sys.stderr)
            return 2
        if not checked.ok:
            print("\n".join(problem_lines(checked)), file=sys.stderr)
            return 2
        manifest = checked.manifest
        assert manifest is not None  # its fields validated
        try:
            settings = RunSettings.of(manifest)
        except AgileLLMEnvsError:  # what it refuses: a manifest without a training section
            print(f"error {args.manifest}: no `training` section to run", file=sys.stderr)
            return 2
        train = {"grpo": train_grpo, "sft": train_sft, "dpo": train_dpo}[settings.algorithm]
        result = train(manifest, resume=args.resume, overwrite=args.overwrite)
    evaluate = None if result.stopped_by is not None else evaluate_hint(result, settings)
    print(summary_line(result, settings, args.manifest, time.monotonic() - started, evaluate))
    return stop_status(result.stopped_by)


def stop_status(stopped_by: str | None) -> int:
    """``train``'s exit status: 0 for a run that reached ``max_steps``; for one a signal
    stopped (checkpoint saved, ``--resume`` continues it), the shell's convention, 128 plus
    the signal's number: 130 for SIGINT, 143 for SIGTERM, so that a scheduler or a script
    does not take it for finished."""
    import signal

    if stopped_by is None:
        return 0
    return 128 + int(signal.Signals[stopped_by])


def evaluate_hint(result: TrainResult, settings: RunSettings) -> str:
    """Write the finished run's eval config, ``<output_dir>/eval.yaml`` (on the main process
    only; a resume that found the run complete touches nothing, and writes the file only when
    the run has none), and return the sentence that says how to run it, or why there is none."""
    from agile_llmenvs._run_files import EVAL_CONFIG
    from agile_llmenvs.training.eval_config import unevaluable_reason, write_eval_config

    path = Path(result.output_dir) / EVAL_CONFIG
    reason = unevaluable_reason(settings.env)
    written = result.already_complete and path.is_file()
    if reason is None and not written and os.environ.get("RANK", "0") == "0":
        try:
            write_eval_config(settings, result)
        except (OSError, AgileLLMEnvsError) as exc:
            reason = f"writing {path} failed: {exc}"
    if reason is None:
        return f"Evaluate with: agile-llmenvs eval {path}"
    model = Path(result.checkpoint_dir or result.output_dir)
    return (
        f"No eval config written: {reason}; evaluate with one of yours: "
        f"agile-llmenvs eval CONFIG.yaml --model {model}"
    )


def summary_line(
    result: TrainResult,
    settings: RunSettings,
    manifest_path: Path,
    wall_s: float,
    evaluate: str | None = None,
) -> str:
    """The last line of ``train``: the steps, the wall time, the mean reward (GRPO) or loss
    (SFT, DPO) over the last tenth of the run's steps, where its files are, and what to run
    next: ``evaluate`` (:func:`evaluate_hint`'s sentence), or, for a stopped run, resume it."""
    from agile_llmenvs.training.run import tail_mean

    max_steps = settings.max_steps
    key, label = _SUMMARY_METRIC[settings.algorithm]
    mean = None
    if result.metrics_path is not None:
        mean = tail_mean(result.metrics_path, key, last_step=result.steps)
    measured = ""
    if mean is not None:
        span = f"step {mean.last}" if mean.first == mean.last else f"steps {mean.first}-{mean.last}"
        measured = f", {label} {mean.value:.4g} over {span}"
    if evaluate is None:
        model = Path(result.checkpoint_dir or result.output_dir)
        evaluate = f"Evaluate with: agile-llmenvs eval CONFIG.yaml --model {model}"
    if result.already_complete:
        return (
            f"{result.output_dir} is already complete at step {result.steps} of {max_steps}"
            f"{measured}; nothing was run (raise training.max_steps to train on). {evaluate}"
        )
    if result.stopped_by is not None:
        return (
            f"stopped by {result.stopped_by} after step {result.steps} of {max_steps} in "
            f"{_duration(wall_s)}{measured}; checkpoint saved in {result.checkpoint_dir}. "
            f"Continue with: agile-llmenvs train {manifest_path} --resume"
        )
    ran_now = len(result.metrics)
    resumed = f" ({ran_now} now, resumed at step {result.steps - ran_now})"
    steps = f"{result.steps} step{'' if result.steps == 1 else 's'}"
    return (
        f"trained {steps}{resumed if ran_now < result.steps else ''} in "
        f"{_duration(wall_s)}{measured}; files in {result.output_dir}. {evaluate}"
    )


def _duration(seconds: float) -> str:
    """``4.2 s``, ``3 min 05 s``, ``2 h 03 min``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
