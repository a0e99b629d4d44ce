"""``agile_llmenvs.weights``: its face, light to import, and the one worker-extension path."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import agile_llmenvs.weights as weights


def test_weights_exports_what_it_names() -> None:
    for name in weights.__all__:
        assert hasattr(weights, name), f"agile_llmenvs.weights.__all__ names missing {name!r}"


def test_the_worker_extension_resolves_to_the_worker() -> None:
    module, _, name = weights.WORKER_EXTENSION.rpartition(".")
    assert getattr(importlib.import_module(module), name) is weights.WeightSyncWorker


def test_finding_a_checkpoint_imports_no_torch() -> None:
    # the eval command and the vLLM launcher reach weights/ without the trainer's libraries
    script = (
        "import json, sys\n"
        "from agile_llmenvs.weights import WORKER_EXTENSION, find_checkpoint\n"
        "import agile_llmenvs.backends.vllm_launch, agile_llmenvs.config.factories\n"
        "print(json.dumps(sorted(m for m in ('torch', 'vllm', 'peft') if m in sys.modules)))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert json.loads(completed.stdout) == []
