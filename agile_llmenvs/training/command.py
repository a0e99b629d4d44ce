"""``agile-llmenvs train MANIFEST [--resume]``: run the manifest's training algorithm."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from pydantic import ValidationError

from agile_llmenvs.errors import AgileLLMEnvsError

__all__ = ["register", "run_train_command"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``train`` subcommand to the ``agile-llmenvs`` parser."""
    parser = subparsers.add_parser(
        "train", help="train the manifest's model with its algorithm (grpo, sft or dpo)"
    )
    parser.add_argument("manifest", type=Path, metavar="MANIFEST", help="a run manifest")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the checkpoint in output_dir"
    )
    parser.set_defaults(run=run_train_command)


def run_train_command(args: argparse.Namespace) -> int:
    """Run ``train``; returns the exit status (1 on a manifest or setup error)."""
    from agile_llmenvs.specs import load_manifest
    from agile_llmenvs.training import train_dpo, train_grpo, train_sft

    try:
        manifest = load_manifest(args.manifest)
    except ValidationError as exc:
        print(f"error {args.manifest}: {exc.error_count()} problem(s)", file=sys.stderr)
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"]) or "(manifest)"
            print(f"  {where}: {error['msg']}", file=sys.stderr)
        return 1
    except (OSError, AgileLLMEnvsError) as exc:
        print(f"error {args.manifest}: {exc}", file=sys.stderr)
        return 1
    if manifest.training is None:
        print(f"error {args.manifest}: no `training` section to run", file=sys.stderr)
        return 1
    train = {"grpo": train_grpo, "sft": train_sft, "dpo": train_dpo}[manifest.training.algorithm]
    try:
        result = train(manifest, resume=args.resume)
    except AgileLLMEnvsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if result.stopped_by is not None:
        print(
            f"stopped by {result.stopped_by} after step {result.steps} of "
            f"{manifest.training.max_steps}; checkpoint saved in {result.checkpoint_dir}. "
            f"Continue with: agile-llmenvs train {args.manifest} --resume"
        )
        return 0
    last = (result.metrics or [{}])[-1]
    summary = ", ".join(f"{k} {v:.4g}" for k, v in last.items() if not math.isnan(v))
    print(f"trained {result.steps} steps into {result.output_dir}: {summary}")
    return 0
