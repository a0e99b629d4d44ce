"""Terminal envs whose episodes live under one test directory, checked for leaks afterwards."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agile_llmenvs.adapters.terminal import TaskFolder, TerminalConfig, TerminalEnvironment

REPO_ROOT = Path(__file__).resolve().parents[2]
TASKS = REPO_ROOT / "manifests" / "data" / "terminal_tasks"
TEST_TASKS = Path(__file__).resolve().parent / "terminal_tasks"

MakeEnv = Callable[..., TerminalEnvironment]


def processes_in(root: Path) -> list[int]:
    """This user's processes working in ``root`` or whose ``HOME`` is under it (the shells
    and everything they started, wherever they ``cd``)."""
    prefix = str(root)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours
            continue
        home = next((v[5:].decode() for v in environ if v.startswith(b"HOME=")), "")
        if cwd.startswith(prefix) or home.startswith(prefix):
            found.append(int(entry.name))
    return found


@pytest.fixture
def work_root(tmp_path: Path) -> Iterator[Path]:
    """Where the episodes' temporary directories go; empty and process-free afterwards."""
    root = tmp_path / "episodes"
    root.mkdir()
    yield root
    assert processes_in(root) == []
    assert list(root.iterdir()) == []


@pytest.fixture
def make_env(work_root: Path) -> Iterator[MakeEnv]:
    """``make_env(tasks_dir=TASKS, **TerminalConfig fields)``; every env made is closed."""
    made: list[TerminalEnvironment] = []

    def make(tasks_dir: Path = TASKS, **config: Any) -> TerminalEnvironment:
        env = TerminalEnvironment(
            TaskFolder(tasks_dir, work_root=work_root), TerminalConfig(**config)
        )
        made.append(env)
        return env

    yield make
    for env in made:
        env.close()


@pytest.fixture
def tasks_dir() -> Path:
    """The example tasks shipped in manifests/data/terminal_tasks."""
    return TASKS


@pytest.fixture
def test_tasks_dir() -> Path:
    """Tasks only tests need (one whose setup is random)."""
    return TEST_TASKS


@pytest.fixture
def live_processes(work_root: Path) -> Callable[[], list[int]]:
    """The processes still running for episodes under ``work_root``."""
    return lambda: processes_in(work_root)
