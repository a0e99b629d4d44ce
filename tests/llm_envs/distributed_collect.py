"""Run by ``torchrun --nproc_per_node 2``: each rank collects one batch; rank 0 writes a report.

Usage: distributed_collect.py TOKENIZER_DIR REPORT_PATH
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist
from echo_envs import RowEnv
from transformers import AutoTokenizer

from agile_llmenvs.llm_envs import RolloutCollector, RolloutHarness


def main() -> None:
    tokenizer_dir, report = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    collector = RolloutCollector(
        lambda: RolloutHarness.local(RowEnv(rows=10), tokenizer),
        batch_size=4,
        group_size=3,
        base_seed=7,
    )
    rows, groups = [], 0
    for _ in range(3):  # 3 steps of 2 groups per rank: 6 of each rank's 5 rows, one epoch over
        batch = collector.collect(lambda contexts: [[5, 2] for _ in contexts])
        groups += len(batch.groups())
        rows += [group[0].task.row_index for group in batch.groups()]
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(
        gathered,
        {
            "rank": collector.rank,
            "world": collector.world_size,
            "rows": rows,
            "groups": groups,
            "slots": collector.num_slots,
        },
    )
    if dist.get_rank() == 0:
        with open(report, "w") as handle:
            json.dump(gathered, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
