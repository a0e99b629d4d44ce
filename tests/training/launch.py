"""Several processes under ``accelerate launch``, for the multi-process tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

# two processes of the multi-GPU launcher: gloo on CPU when no GPU is visible
TWO_PROCESSES = (
    "--multi_gpu",
    "--num_processes",
    "2",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
)


def accelerate_launch(
    launcher_args: Sequence[str], *args: str, timeout: float = 300, cpu: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``accelerate launch LAUNCHER_ARGS ARGS`` (``ARGS``: a script, or ``-m module``).

    Each launch has the launcher pick a free port for its processes' rendezvous. Its default,
    29500, is checked and then bound, so two launches started at one moment (the other test
    worker's) can both find it free and one fails with EADDRINUSE.
    """
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", "0")
    command = [*launcher, *launcher_args, *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def launch_two(script: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``script args`` in 2 gloo processes on CPU."""
    return accelerate_launch(TWO_PROCESSES, str(script), *args, timeout=timeout)
