"""How many intra-op threads a CPU run uses: one for a small model unless someone chose."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from agile_llmenvs.specs import RunManifest
from agile_llmenvs.training import train_grpo
from agile_llmenvs.training.policy import (
    SMALL_MODEL_PARAMETERS,
    choose_cpu_threads,
    set_cpu_threads,
    threads,
)


@pytest.fixture(autouse=True)
def restore_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts from torch's default count, with no thread variable set."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_TORCH_DEFAULT", before)
    monkeypatch.setattr(threads, "_ours", None)
    yield
    torch.set_num_threads(before)


def test_a_small_model_runs_on_one_thread() -> None:
    assert choose_cpu_threads(130_000) == (1, "a small model (130,000 parameters)")


def test_a_large_model_keeps_torchs_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "_TORCH_DEFAULT", 6)
    torch.set_num_threads(6)
    assert choose_cpu_threads(SMALL_MODEL_PARAMETERS).threads == 6


def test_the_manifest_wins() -> None:
    assert choose_cpu_threads(130_000, configured=3) == (3, "training.cpu_threads")


def test_a_thread_variable_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    choice = choose_cpu_threads(130_000)
    assert choice == (torch.get_num_threads(), "OMP_NUM_THREADS")


def test_a_users_set_num_threads_wins() -> None:
    torch.set_num_threads(threads._TORCH_DEFAULT + 1)
    choice = choose_cpu_threads(130_000)
    assert choice == (threads._TORCH_DEFAULT + 1, "torch.set_num_threads")


def test_a_count_set_by_an_earlier_run_is_not_a_users_choice() -> None:
    model = torch.nn.Linear(4, 4)
    assert set_cpu_threads(model, 2, torch.device("cpu")) == 2  # an earlier run's manifest
    assert set_cpu_threads(model, None, torch.device("cpu")) == 1
    assert torch.get_num_threads() == 1


def test_nothing_is_set_off_the_cpu() -> None:
    before = torch.get_num_threads()
    assert set_cpu_threads(torch.nn.Linear(4, 4), 1, torch.device("meta")) is None
    assert torch.get_num_threads() == before


def test_a_run_on_the_tiny_model_uses_one_thread_and_says_so(
    make_manifest: Callable[..., RunManifest],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(threads, "_TORCH_DEFAULT", 2)
    torch.set_num_threads(2)
    with caplog.at_level("INFO", logger="agile_llmenvs.training.policy.threads"):
        train_grpo(make_manifest("quickstart.yaml", max_steps=1, batch_size=2, group_size=2))
    assert torch.get_num_threads() == 1
    [record] = [r for r in caplog.records if r.name == "agile_llmenvs.training.policy.threads"]
    assert record.getMessage().startswith("torch intra-op threads: 1 (a small model (")
