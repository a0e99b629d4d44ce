"""What every training loop shares: the policy, the metrics file and plot, checkpoints."""

from __future__ import annotations

import copy
import csv
import logging
import random
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agile_llmenvs.errors import AgileLLMEnvsError
from agile_llmenvs.specs import ModelSpec, RunManifest, TrainingSpec

__all__ = [
    "CheckpointError",
    "MetricsWriter",
    "TrainResult",
    "load_checkpoint",
    "load_policy",
    "plot_metrics",
    "save_checkpoint",
    "training_spec",
]

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoint"
_RNG_FILE = "rng_rank{rank}.pt"


class CheckpointError(AgileLLMEnvsError):
    """A run cannot resume: no checkpoint, or one saved by another setup."""


@dataclass(frozen=True)
class TrainResult:
    """What a training run leaves behind.

    Attributes:
        output_dir: The run's folder.
        steps: Optimizer steps completed, counting those before a resume.
        metrics: This process's metric rows, one per step run now.
        metrics_path: The CSV of every step (appended to on resume).
        checkpoint_dir: The last checkpoint.
    """

    output_dir: Path
    steps: int
    metrics: list[dict[str, float]] = field(default_factory=list)
    metrics_path: Path | None = None
    checkpoint_dir: Path | None = None

    def last(self, key: str) -> float:
        """The value of ``key`` at the last step run now."""
        return self.metrics[-1][key]


def training_spec(manifest: RunManifest) -> TrainingSpec:
    """The manifest's training section.

    Raises:
        AgileLLMEnvsError: the manifest has none.
    """
    if manifest.training is None:
        raise AgileLLMEnvsError("the manifest has no `training` section: add one to train")
    return manifest.training


def load_policy(spec: ModelSpec) -> tuple[Any, Any]:
    """Load the model (``spec.path``, else the built-in tiny model) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agile_llmenvs.tiny_model import ensure_tiny_model

    path = spec.path or str(ensure_tiny_model())
    tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path or path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, spec.dtype))
    return model, tokenizer


def prepare_policy(manifest: RunManifest, config: TrainingSpec) -> tuple[Any, Any, Any, Any]:
    """Seed, load the policy and its tokenizer, and prepare it with AdamW on ``accelerate``.

    Returns:
        ``(accelerator, model, optimizer, tokenizer)``; ``accelerator.unwrap_model(model)``
        is the plain model (for generation, or a frozen reference copy).
    """
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    seed_everything(manifest.seed)
    model, tokenizer = load_policy(manifest.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer, tokenizer


def frozen_copy(model: Any, device: Any) -> Any:
    """A copy of ``model`` on ``device`` in eval mode with no gradients: a fixed reference."""
    reference = copy.deepcopy(model).to(device).eval()
    reference.requires_grad_(False)
    return reference


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's global generators."""
    random.seed(seed)
    torch.manual_seed(seed)


class MetricsWriter:
    """Appends one CSV row per step under a fixed header (the stable metric keys).

    Args:
        path: The CSV file.
        keys: Its columns, in order.
        append: Keep the rows already there (a resumed run); else start the file over.
    """

    def __init__(self, path: Path, keys: Sequence[str], *, append: bool) -> None:
        self.path, self.keys = path, list(keys)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not (append and path.exists()):
            with path.open("w", newline="", encoding="utf-8") as file:
                csv.writer(file).writerow(self.keys)

    def write(self, row: Mapping[str, float]) -> None:
        """Append ``row`` (every key of the header, nothing else)."""
        with self.path.open("a", newline="", encoding="utf-8") as file:
            csv.DictWriter(file, self.keys).writerow({k: _format(row[k]) for k in self.keys})


def _format(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The rows of a metrics CSV, as floats."""
    with path.open(newline="", encoding="utf-8") as file:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(file)]


def plot_metrics(metrics_path: Path, png_path: Path, keys: Sequence[str]) -> Path | None:
    """Plot ``keys`` against ``step``, one panel each; skipped (None) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed: no plot of the run", stacklevel=2)
        return None
    rows = read_metrics(metrics_path)
    steps = [row["step"] for row in rows]
    figure, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.2), squeeze=False)
    for axis, key in zip(axes[0], keys, strict=True):
        axis.plot(steps, [row[key] for row in rows])
        axis.set_xlabel("step")
        axis.set_title(key)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    plt.close(figure)
    return png_path


def save_checkpoint(
    output_dir: Path,
    *,
    step: int,
    accelerator: Any,
    model: Any,
    optimizer: torch.optim.Optimizer,
    tokenizer: Any,
    rank_state: Mapping[str, Any],
) -> Path:
    """Save the model (Hugging Face layout), optimizer, step and every rank's RNG and data state.

    ``rank_state`` is this rank's own (its collector or dataset position); each rank writes
    its file, the main process the shared ones.
    """
    directory = output_dir / CHECKPOINT_DIR
    directory.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    state = {"rng": _rng_state(), **rank_state}
    torch.save(state, directory / _RNG_FILE.format(rank=accelerator.process_index))
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(directory / "model")
        tokenizer.save_pretrained(directory / "model")
        torch.save({"step": step, "optimizer": optimizer.state_dict()}, directory / "trainer.pt")
    accelerator.wait_for_everyone()
    return directory


def load_checkpoint(
    output_dir: Path, *, accelerator: Any, model: Any, optimizer: torch.optim.Optimizer
) -> tuple[int, dict[str, Any]]:
    """Restore what :func:`save_checkpoint` wrote; returns the step and this rank's state.

    Raises:
        CheckpointError: there is no checkpoint, or none for this rank.
    """
    from safetensors.torch import load_file

    directory = output_dir / CHECKPOINT_DIR
    rank_file = directory / _RNG_FILE.format(rank=accelerator.process_index)
    if not (directory / "trainer.pt").exists() or not rank_file.exists():
        raise CheckpointError(
            f"no checkpoint to resume from in {directory} for rank {accelerator.process_index}: "
            "run without --resume first, with the same number of processes"
        )
    weights = load_file(str(directory / "model" / "model.safetensors"))
    accelerator.unwrap_model(model).load_state_dict(weights, strict=False)
    trainer = torch.load(directory / "trainer.pt", weights_only=False)
    optimizer.load_state_dict(trainer["optimizer"])
    state = torch.load(rank_file, weights_only=False)
    _set_rng_state(state.pop("rng"))
    return int(trainer["step"]), state


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def _set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
