"""Two gloo processes under ``accelerate launch``: disjoint tasks, identical parameters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from training.launch import launch_two

HERE = Path(__file__).resolve().parent
MANIFEST = HERE.parents[1] / "manifests" / "quickstart.yaml"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher")
def test_two_ranks_draw_disjoint_tasks_and_stay_in_sync(tmp_path: Path) -> None:
    done = launch_two(HERE / "distributed_grpo.py", str(MANIFEST), str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    # 2 steps x 2 groups per rank; the digits file has 10 rows, sharded between the ranks
    assert [len(r["rows"]) for r in ranks] == [4, 4]
    assert not set(ranks[0]["rows"]) & set(ranks[1]["rows"])
    assert ranks[0]["params"] == ranks[1]["params"]
    assert ranks[0]["grad_steps"] == 2
