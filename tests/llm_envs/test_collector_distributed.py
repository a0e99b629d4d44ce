"""Two real gloo processes under torchrun: each rank's collector draws its own shard."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_each_rank_gets_its_own_shard_and_the_same_number_of_groups(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    report = tmp_path / "report.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), *sys.path]),
        "OMP_NUM_THREADS": "1",
    }
    log = (tmp_path / "torchrun.log").open("w")
    command = [
        torchrun,
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HERE / "distributed_collect.py"),
        str(tiny_model_dir),
        str(report),
    ]
    proc = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        returncode = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        returncode = -1
    log.close()
    assert returncode == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    ranks = json.loads(report.read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["world"] == 2 for r in ranks)
    assert all(r["slots"] == 6 for r in ranks)  # (4 groups / 2 ranks) x 3
    assert ranks[0]["groups"] == ranks[1]["groups"] == 6
    first_epoch = [r["rows"][:5] for r in ranks]
    assert not set(first_epoch[0]) & set(first_epoch[1])
    assert set(first_epoch[0]) | set(first_epoch[1]) == set(range(10))
