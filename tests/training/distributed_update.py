"""Run under ``accelerate launch`` with 2 processes: one GRPO update on the synthetic batch,
rank 0 holding rows 0-4 and rank 1 rows 5-6 (unequal shares, unequal micro-batch counts).

Usage: ``distributed_update.py MODEL_DIR LOSS_TYPE OUTPUT_FILE``; each rank saves its
parameter change to ``OUTPUT_FILE.rank{r}``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parent))

from update_cases import update_delta

from agile_llmenvs.training.grpo import UpdateSettings

if __name__ == "__main__":
    model_dir, loss_type, output = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    rows = slice(0, 5) if rank == 0 else slice(5, 7)
    settings = UpdateSettings(loss_type=loss_type, max_completion_tokens=20, micro_batch_size=2)  # type: ignore[arg-type]
    delta, metrics = update_delta(model_dir, settings, accelerator=accelerator, rows=rows)
    torch.save({"delta": delta, "metrics": metrics}, f"{output}.rank{rank}")
