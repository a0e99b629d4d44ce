"""Run under ``accelerate launch``: one GRPO step, then each rank writes what it drew and saw.

Usage: ``distributed_grpo.py MANIFEST OUTPUT_DIR [fsdp]``; rank ``r`` writes
``OUTPUT_DIR/rank{r}.json`` with the dataset rows of its groups, the first values of each of
its (whole) parameters after the steps, and the steps' metrics; ``fsdp`` shards the policy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from agile_llmenvs.llm_envs.collector import RolloutCollector
from agile_llmenvs.specs import load_manifest
from agile_llmenvs.training import train_grpo
from agile_llmenvs.training.grpo import loop as grpo_loop
from agile_llmenvs.training.run import book

rows: list[int | None] = []
collect = RolloutCollector.collect


def _recording_collect(self: RolloutCollector, *args: Any, **kwargs: Any) -> Any:
    batch = collect(self, *args, **kwargs)
    rows.extend(t.task.row_index for t in batch.trajectories[:: batch.group_size])
    return batch


def _whole(param: Any) -> Any:
    """A parameter's full value (an FSDP2 shard gathered)."""
    full = getattr(param, "full_tensor", None)
    return (full() if callable(full) else param).detach()


steps: list[dict[str, float]] = []
write_row = grpo_loop._step


def _recording_step(*args: Any, **kwargs: Any) -> dict[str, float]:
    row = write_row(*args, **kwargs)
    steps.append(row)
    return row


def _recording_save(output_dir: Path, learner: Any, *, step: int, **_: Any) -> Path:
    policy = learner.accelerator.unwrap_model(learner.model)
    params = [_whole(p).flatten()[:8].tolist() for p in policy.parameters()]
    rank = learner.accelerator.process_index
    record = {
        "world_size": learner.accelerator.num_processes,
        "rows": rows,
        "params": params,
        "grad_steps": step,
        "metrics": [{k: row[k] for k in ("loss", "reward_mean", "grad_norm")} for row in steps],
    }
    (output_dir / f"rank{rank}.json").write_text(json.dumps(record))
    return output_dir


if __name__ == "__main__":
    RolloutCollector.collect = _recording_collect  # type: ignore[method-assign]
    book.save_checkpoint = _recording_save  # type: ignore[assignment]
    grpo_loop._step = _recording_step  # type: ignore[assignment]
    manifest = load_manifest(sys.argv[1])
    assert manifest.training is not None
    training = manifest.training.model_copy(
        update={
            "max_steps": 2,
            "batch_size": 4,
            "group_size": 4,
            "output_dir": sys.argv[2],
            "fsdp": sys.argv[3:] == ["fsdp"],
        }
    )
    Path(sys.argv[2]).mkdir(parents=True, exist_ok=True)
    # a dense reward, so each rank's gradient is its own and only the all-reduce syncs them
    rubric = str(Path(__file__).resolve().parent / "rubrics.py")
    env = manifest.env.model_copy(update={"rubric_file_path": rubric, "rubric_name": "digit_share"})
    train_grpo(manifest.model_copy(update={"training": training, "env": env}))
