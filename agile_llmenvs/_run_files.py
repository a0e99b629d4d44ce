"""The names of what a training run writes in its folder (``training.output_dir``), each once.

The trainer writes these files and folders; ``agile-llmenvs show`` (the viewer), ``eval``
(a run folder or checkpoint as the model) and a resume read them. Every module that names one
takes it from here, so writer and readers cannot drift apart. It imports nothing of the
package (the bottom layer), so the command line's ``--help`` and the viewer stay light.
"""

from __future__ import annotations

import re

__all__ = [
    "CHECKPOINT_MANIFEST",
    "CHECKPOINT_MODEL_DIR",
    "CHECKPOINT_NAME",
    "CHECKPOINT_PREFIX",
    "CHECKPOINT_RANK_FILE",
    "CHECKPOINT_TRAINER_FILE",
    "CHECKPOINT_WEIGHTS_FILE",
    "CHECKPOINT_WEIGHTS_INDEX",
    "EVAL_CONFIG",
    "METRICS_FILE",
    "METRICS_PLOT",
    "MLFLOW_DIR",
    "PARTIAL_SUFFIX",
    "ROLLOUTS_FILE",
    "ROLLOUTS_PAGE",
    "RUN_FILES",
    "RUN_LOCK",
    "RUN_MANIFEST",
    "RUN_MARKER",
    "STALE_SUFFIX",
    "TENSORBOARD_DIR",
    "TRACKER_IDS",
    "WANDB_DIR",
    "WEIGHTS_SYNC_DIR",
    "checkpoint_name",
]

#: The per-step metrics, one CSV row per step.
METRICS_FILE = "metrics.csv"
#: Their plot.
METRICS_PLOT = "metrics.png"
#: The folder, next to ``metrics.csv``, that holds the TensorBoard event files.
TENSORBOARD_DIR = "tensorboard"
#: The manifest a run ran, its paths made absolute (what a resume compares).
RUN_MANIFEST = "manifest.yaml"
#: The eval config ``agile-llmenvs train`` writes for the run it finished.
EVAL_CONFIG = "eval.yaml"
#: The logged episodes, token-exact (``training.log_rollouts_every``).
ROLLOUTS_FILE = "rollouts.jsonl"
#: The page ``agile-llmenvs show`` writes from them.
ROLLOUTS_PAGE = "rollouts.html"
#: Each experiment tracker's run id, for a resume to continue them.
TRACKER_IDS = "trackers.json"
#: ``training.report_to``'s W&B runs and MLflow file store.
WANDB_DIR = "wandb"
MLFLOW_DIR = "mlruns"
#: Written first by every run into its folder: what lets ``--overwrite`` delete the run's files
#: there (a folder holding files named like a run's without it is not a run's: it is refused).
RUN_MARKER = ".agile-llmenvs-run"
#: The lock file the run writing a folder holds (its pid inside, for the refusal to name).
RUN_LOCK = ".run.lock"
#: Where a sharded policy's weights go for its vLLM engines to read (one folder per sync).
WEIGHTS_SYNC_DIR = "weights-sync"

#: A checkpoint is the folder ``checkpoint-<step>``.
CHECKPOINT_PREFIX = "checkpoint-"
CHECKPOINT_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")
#: A checkpoint being written (``checkpoint-<step>.partial``), and one being replaced.
PARTIAL_SUFFIX = ".partial"
STALE_SUFFIX = ".stale"
#: In a checkpoint: its manifest (each file with its size, written last), the model in
#: Hugging Face's layout (or a LoRA run's adapters in peft's), the trainer's state and each
#: rank's own.
CHECKPOINT_MANIFEST = "manifest.json"
CHECKPOINT_MODEL_DIR = "model"
CHECKPOINT_WEIGHTS_FILE = "model.safetensors"
CHECKPOINT_WEIGHTS_INDEX = "model.safetensors.index.json"
CHECKPOINT_TRAINER_FILE = "trainer.pt"
CHECKPOINT_RANK_FILE = "rank{rank}.pt"

#: What a run writes besides its checkpoints (``agile-llmenvs show`` adds the page of its
#: rollouts): an overwrite removes these and the checkpoint folders, nothing else.
RUN_FILES = (
    RUN_MARKER,
    METRICS_FILE,
    METRICS_PLOT,
    TENSORBOARD_DIR,
    RUN_MANIFEST,
    ROLLOUTS_FILE,
    ROLLOUTS_PAGE,
    EVAL_CONFIG,
    WANDB_DIR,
    MLFLOW_DIR,
    TRACKER_IDS,
)


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint saved after ``step`` optimizer steps."""
    return f"{CHECKPOINT_PREFIX}{step}"
