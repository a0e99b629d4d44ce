"""A training run that SIGKILLs itself at a chosen moment, for the kill-and-resume tests.

Usage: ``killed_run.py MANIFEST.json KILL_AT [--resume]``. ``KILL_AT`` is ``none`` or
``WHERE:N``: the N-th time the run reaches ``WHERE`` (1-based) it kills itself with SIGKILL:

- ``generate``: a generate call of the rollout sampler (GRPO: during a rollout);
- ``learn``: an optimizer step, before it updates the weights in place;
- ``save``: the start of a checkpoint save;
- ``trainer_file``: inside a save, after the model files, before the trainer state;
- ``publish``: inside a save, after every file, before the manifest and the rename;
- ``prune``: after a save was published, before older checkpoints are removed.

Each completed step appends ``{"step", "rows"}`` (the dataset rows it trained on) to
``OUTPUT_DIR/steps.jsonl``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from agile_llmenvs.backends.hf import HFBackend
from agile_llmenvs.llm_envs.collector import RolloutCollector
from agile_llmenvs.llm_envs.dataset_env import DatasetEnv
from agile_llmenvs.specs import RunManifest
from agile_llmenvs.training import train_grpo, train_sft
from agile_llmenvs.training.policy import Learner
from agile_llmenvs.training.run import book, checkpoint

counts: dict[str, int] = {}
rows: list[Any] = []


def _reach(where: str, kill_at: str) -> None:
    counts[where] = counts.get(where, 0) + 1
    if kill_at == f"{where}:{counts[where]}":
        os.kill(os.getpid(), signal.SIGKILL)


def _wrap(owner: Any, name: str, where: str, kill_at: str, *, after: bool = False) -> None:
    real = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not after:
            _reach(where, kill_at)
        result = real(*args, **kwargs)
        if after:
            _reach(where, kill_at)
        return result

    setattr(owner, name, wrapped)


def _install(kill_at: str, log: Path) -> None:
    _wrap(HFBackend, "generate", "generate", kill_at)
    _wrap(Learner, "step", "learn", kill_at)
    _wrap(book, "save_checkpoint", "save", kill_at)  # where every loop's saves call it from
    _wrap(checkpoint, "publish_checkpoint", "publish", kill_at)
    _wrap(checkpoint, "prune_checkpoints", "prune", kill_at)
    real_save = checkpoint._save_synced

    def save_synced(obj: Any, path: Path) -> None:
        if path.name == "trainer.pt":
            _reach("trainer_file", kill_at)
        real_save(obj, path)

    checkpoint._save_synced = save_synced  # type: ignore[assignment]

    # what each step trained on: the groups' rows (GRPO) or the batch's rows (SFT)
    collect = RolloutCollector.collect

    def recording_collect(self: RolloutCollector, *args: Any, **kwargs: Any) -> Any:
        batch = collect(self, *args, **kwargs)
        rows.append([t.task.row_index for t in batch.trajectories[:: batch.group_size]])
        return batch

    RolloutCollector.collect = recording_collect  # type: ignore[method-assign]
    next_batch = DatasetEnv.next_batch

    def recording_next_batch(self: DatasetEnv) -> Any:
        batch = next_batch(self)
        rows.append(batch.input_ids[:, :6].tolist())
        return batch

    DatasetEnv.next_batch = recording_next_batch  # type: ignore[method-assign]

    from agile_llmenvs.training.run import metrics

    write = metrics.MetricsWriter.write

    def recording_write(self: Any, row: dict[str, float]) -> None:
        write(self, row)
        with log.open("a") as file:
            file.write(json.dumps({"step": int(row["step"]), "rows": rows[-1]}) + "\n")

    metrics.MetricsWriter.write = recording_write  # type: ignore[method-assign]


if __name__ == "__main__":
    manifest = RunManifest.model_validate_json(Path(sys.argv[1]).read_text())
    assert manifest.training is not None
    output_dir = Path(manifest.training.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    _install(sys.argv[2], output_dir / "steps.jsonl")
    train = train_grpo if manifest.training.algorithm == "grpo" else train_sft
    train(manifest, resume="--resume" in sys.argv[3:])
