"""``agile-llmenvs eval CONFIG.yaml``: run an EvalConfig, show progress, print a table.

Every environment of the config runs in one interleaved lock-step loop
(:func:`run_multi_evaluation`), so each step is one backend call across all of them.
``--limit`` and ``--max-tokens`` shorten a run without editing the config; ``--model`` swaps
the model (a training run's folder or checkpoint, say). ``backend: huggingface`` over a
vision-language model shows it the env's images, framed by the model's processor.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from agile_llmenvs.errors import AgileLLMEnvsError

if TYPE_CHECKING:  # the command line imports this module for --help: torch only when it runs
    from agile_llmenvs.backends.types import Backend
    from agile_llmenvs.config import EnvironmentConfig, EvalConfig, ModelConfig, ResultsConfig
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
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help="run only the first N tasks of each environment",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="override the config's inference.max_tokens (tokens generated per step)",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="MODEL",
        help="override the config's model.model: a model folder, a training run's output_dir "
        "(its newest checkpoint) or a checkpoint-<step> folder, for a local backend",
    )
    parser.add_argument(
        "--token-ids",
        action="store_true",
        help="write each action's sampled token ids into --output (results.token_ids)",
    )
    parser.set_defaults(run=run_eval_command)


def run_eval_command(args: argparse.Namespace) -> int:
    """Run ``eval``; returns the exit status (2 on a config or setup error)."""
    from agile_llmenvs.config import EvalConfig

    try:
        config = EvalConfig.from_yaml(args.config)
    except ValidationError as exc:
        print(f"error {args.config}: {exc.error_count()} problem(s)", file=sys.stderr)
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"]) or "(config)"
            print(f"  {where}: {error['msg']}", file=sys.stderr)
        return 2
    except AgileLLMEnvsError as exc:
        print(f"error {args.config}: {exc}", file=sys.stderr)
        return 2
    for flag in ("batch_size", "limit", "max_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            print(f"error: --{flag.replace('_', '-')} must be >= 1, got {value}", file=sys.stderr)
            return 2
    config = _with_overrides(config, args)
    try:
        results = _evaluate(config, args.batch_size or config.batch_size, args.limit)
    except AgileLLMEnvsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(results))
    if args.output is not None:
        payload = {
            "config": config.model_dump(mode="json"),
            "limit": args.limit,
            **_report(results, config.results),
        }
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.output}")
    return 0


def _with_overrides(config: EvalConfig, args: argparse.Namespace) -> EvalConfig:
    """``config`` with the command line's overrides applied (and so recorded in results)."""
    if args.max_tokens is not None:
        inference = config.inference.model_copy(update={"max_tokens": args.max_tokens})
        config = config.model_copy(update={"inference": inference})
    if args.model is not None:
        config = config.model_copy(
            update={"model": config.model.model_copy(update={"model": args.model})}
        )
    if args.token_ids:
        results = config.results.model_copy(update={"token_ids": True})
        config = config.model_copy(update={"results": results})
    return config


def _evaluate(config: EvalConfig, batch_size: int | None, limit: int | None) -> list[BatchResult]:
    from agile_llmenvs.config import BackendFactory, EnvironmentFactory, create_sampling_params
    from agile_llmenvs.evaluation.multi import MultiEvalEntry, run_multi_evaluation
    from agile_llmenvs.evaluation.progress import ProgressDisplay
    from agile_llmenvs.evaluation.runner import RunnerConfig, TrajectoryRunner

    with _loader_bars_off_outside_a_terminal():
        environments = [EnvironmentFactory.create(e) for e in config.environments]
        backend = _image_backend(BackendFactory.create(config.model), config.model)
    params = create_sampling_params(config.inference)
    try:
        entries = []
        for env_config, env in zip(config.environments, environments, strict=True):
            runner_config = RunnerConfig(
                config.system_prompt, max_steps=env_config.max_steps, seed=_reset_seed(env_config)
            )
            runner = TrajectoryRunner(env, backend, params, config=runner_config)
            count = min(env_config.size, env.spec.dataset_size or env_config.size)
            entries.append(MultiEvalEntry(runner, range(min(count, limit or count))))
        display = ProgressDisplay(sys.stderr)
        try:
            return run_multi_evaluation(entries, batch_size, on_step=display)
        finally:
            display.close()
    finally:
        backend.close()
        for env in environments:
            env.close()


def _image_backend(backend: Backend, model: ModelConfig) -> Backend:
    """``backend``, or for an HF backend over a vision-language model, the backend that shows
    it the env's images (framed with the processor saved beside the model)."""
    from agile_llmenvs.backends.hf import HFBackend

    if not isinstance(backend, HFBackend) or not backend.supports_images:
        return backend
    from agile_llmenvs.config.factories import model_directory
    from agile_llmenvs.evaluation.images import ImageChatBackend
    from agile_llmenvs.tiny_vlm import load_processor

    try:
        return ImageChatBackend(backend, load_processor(model_directory(model.model)))
    except BaseException:
        backend.close()
        raise


def _reset_seed(env: EnvironmentConfig) -> int | None:
    """The seed task 0 of an entry-point or manifest env is reset with (task ``i``: ``seed +
    i``), so a procedural env plays the same tasks every run; reasoning-gym envs are seeded
    when built."""
    return env.seed if env.source in ("entry_point", "manifest") else None


@contextlib.contextmanager
def _loader_bars_off_outside_a_terminal() -> Iterator[None]:
    """Outside a terminal, turn off the progress bars of transformers and datasets (their
    carriage returns garble a log); the evaluation's own display writes plain lines."""
    if sys.stderr.isatty():
        yield
        return
    import datasets.utils.logging as datasets_logging
    import transformers.utils.logging as transformers_logging

    modules = [datasets_logging, transformers_logging]
    enabled = [m for m in modules if m.is_progress_bar_enabled()]
    for module in enabled:
        module.disable_progress_bar()
    try:
        yield
    finally:
        for module in enabled:
            module.enable_progress_bar()


def _report(results: Sequence[BatchResult], settings: ResultsConfig) -> dict[str, Any]:
    from agile_llmenvs.evaluation.results import BatchResult

    merged = BatchResult.concat(results, "overall")
    return {
        "overall": merged.summary(),
        "environments": [
            r.to_dict(max_text_chars=settings.max_text_chars, token_ids=settings.token_ids)
            for r in results
        ],
    }


def format_table(results: Sequence[BatchResult]) -> str:
    """A plain-text table: one row per environment, then the overall row (always, so a
    one-environment table has the same shape as any other)."""
    from agile_llmenvs.evaluation.results import BatchResult

    rows = [r.summary() for r in results]
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
