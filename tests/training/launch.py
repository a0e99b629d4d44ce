"""Two gloo processes under ``accelerate launch`` on CPU, for the multi-process tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def launch_two(script: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``script args`` in 2 processes (``--multi_gpu`` with no GPU: gloo on CPU)."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(script),
        *args,
    ]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
