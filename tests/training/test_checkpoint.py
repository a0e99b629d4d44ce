"""Checkpoints load only what they can load exactly, and say why when they cannot."""

from __future__ import annotations

import csv
import errno
import functools
import json
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, AutoTokenizer

from agile_llmenvs.errors import CheckpointError
from agile_llmenvs.training.policy import Learner
from agile_llmenvs.training.run import MetricsWriter, load_checkpoint, save_checkpoint
from agile_llmenvs.weights import find_checkpoint


class Payload:
    """Anything but plain data: unpickling it would run code of the sender's choosing."""


def _learner(model: Any) -> Learner:
    """``model`` with AdamW on one CPU process, no schedule."""
    optimizer = torch.optim.AdamW(model.parameters())
    return Learner(Accelerator(cpu=True), model, optimizer, scheduler=None, max_grad_norm=1.0)


def _save(model_dir: Path, out: Path, step: int = 1, **kwargs: Any) -> Path:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    for name, value in kwargs.items():
        setattr(model, name, value)
    return save_checkpoint(
        out,
        _learner(model),
        step=step,
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        rank_state={"position": 3},
    )


def _load(model: Any, out: Path) -> tuple[int, dict[str, Any]]:
    return load_checkpoint(out, _learner(model))


def _refresh_manifest(directory: Path) -> None:
    """Re-record the file sizes, as a complete save of these files would have."""
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"] = {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))


def test_a_round_trip_restores_the_step_and_the_rank_state(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    directory = _save(tiny_model_dir, tmp_path)
    assert directory == tmp_path / "checkpoint-1"
    assert sorted(p.name for p in directory.iterdir()) == [
        "manifest.json",
        "model",
        "rank0.pt",
        "trainer.pt",
    ]
    step, state = _load(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path)
    assert (step, state) == (1, {"position": 3})


def test_a_gpus_generator_is_saved_and_restored(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # no GPU here: torch.cuda's generator calls stand in for a device's, byte for byte
    device_state = {"now": torch.arange(16, dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: device_state["now"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: device_state.update(now=s))
    _save(tiny_model_dir, tmp_path)
    saved = torch.load(tmp_path / "checkpoint-1" / "rank0.pt", weights_only=True)["rng"]
    assert torch.equal(saved["cuda"], torch.arange(16, dtype=torch.uint8))
    device_state["now"] = torch.zeros(16, dtype=torch.uint8)  # the generator moved on
    _load(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path)
    assert torch.equal(device_state["now"], torch.arange(16, dtype=torch.uint8))


def test_weights_of_another_architecture_are_refused_naming_the_keys(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    _save(tiny_model_dir, tmp_path)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_hidden_layers = 3  # the checkpoint has 2
    config.layer_types = [config.layer_types[0]] * 3
    deeper = AutoModelForCausalLM.from_config(config)
    with pytest.raises(CheckpointError) as raised:
        _load(deeper, tmp_path)
    message = str(raised.value)
    assert message.startswith(f"the weights in {tmp_path / 'checkpoint-1' / 'model'} do not fit")
    assert "missing model.layers.2." in message
    assert "unexpected none" in message


def test_a_missing_shard_makes_the_checkpoint_incomplete(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    sharded = functools.partial(model.save_pretrained, max_shard_size="100KB")
    directory = _save(tiny_model_dir, tmp_path, save_pretrained=sharded)
    shards = sorted((directory / "model").glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointError, match="no complete"):
        _load(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path)
    assert f"model/{shards[1].name} is missing" in caplog.text
    # a manifest that agrees (a save that never had the shard): refused by the index
    _refresh_manifest(directory)
    with pytest.raises(CheckpointError, match=rf"lacks its shard\(s\) \['{shards[1].name}'\]"):
        _load(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path)


def test_a_pickled_object_in_the_trainer_state_is_not_loaded(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    directory = _save(tiny_model_dir, tmp_path)
    trainer = torch.load(directory / "trainer.pt", weights_only=True)
    torch.save({**trainer, "payload": Payload()}, directory / "trainer.pt")
    _refresh_manifest(directory)
    with pytest.raises(CheckpointError, match="holds more than tensors and plain values"):
        _load(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path)


def test_the_newest_complete_checkpoint_wins_and_partial_ones_are_reported(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save(tiny_model_dir, tmp_path, step=1)
    newest = _save(tiny_model_dir, tmp_path, step=2)
    (tmp_path / "checkpoint-3.partial").mkdir()
    truncated = tmp_path / "checkpoint-4"
    truncated.mkdir()
    with caplog.at_level(logging.WARNING):
        found = find_checkpoint(tmp_path)
    assert found is not None
    assert (found.directory, found.step, found.world_size) == (newest, 2, 1)
    assert "checkpoint-3.partial: a checkpoint save that did not finish" in caplog.text
    assert "checkpoint-4: it has no manifest.json" in caplog.text
    # a published folder whose file changed size after the save
    with (newest / "rank0.pt").open("ab") as file:
        file.write(b"x")
    found = find_checkpoint(tmp_path)
    assert found is not None
    assert found.step == 1


@pytest.mark.parametrize(
    ("code", "why"),
    [(errno.ENOSPC, "the disk is full"), (errno.EDQUOT, "the disk quota is used up")],
)
def test_a_full_disk_during_a_save_says_so_and_keeps_the_previous_checkpoint(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, why: str
) -> None:
    """A real full disk cannot be made here without a filesystem of our own to fill (a
    loop mount needs root, which a test must not assume), so ``torch.save`` is made to fail
    as it does on one: some bytes written, then ``OSError(ENOSPC)`` (or ``EDQUOT``)."""
    previous = _save(tiny_model_dir, tmp_path, step=1)
    before = {p: p.read_bytes() for p in sorted(previous.rglob("*")) if p.is_file()}

    def save_on_a_full_disk(obj: Any, file: Any) -> None:
        """``torch.save`` on a full disk, as it behaves writing to ``/dev/full``: given a
        path, its own writer fails with a ``RuntimeError`` that names no cause; given a
        Python file, the file's ``OSError`` comes through."""
        if isinstance(file, str | os.PathLike):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704")
        file.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(torch, "save", save_on_a_full_disk)
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: SimpleNamespace(total=10, used=9, free=1)
    )
    with pytest.raises(CheckpointError) as raised:
        _save(tiny_model_dir, tmp_path, step=2)
    assert str(raised.value) == (
        f"saving checkpoint-2 in {tmp_path} failed: {why} (1 bytes free there). Free some "
        "space (or keep fewer checkpoints with training.keep_checkpoints), then continue the "
        "run with --resume"
    )
    assert isinstance(raised.value.__cause__, OSError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]  # no .partial left
    assert {p: p.read_bytes() for p in sorted(previous.rglob("*")) if p.is_file()} == before
    found = find_checkpoint(tmp_path)
    assert found is not None
    assert found.step == 1


def test_a_full_disk_while_writing_a_metrics_row_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = MetricsWriter(tmp_path / "metrics.csv", ["step", "loss"], tensorboard=False)

    def full(self: Any, row: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(csv.DictWriter, "writerow", full)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=0))
    with pytest.raises(CheckpointError) as raised:
        writer.write({"step": 1.0, "loss": 0.5})
    assert str(raised.value) == (
        f"writing metrics.csv in {tmp_path} failed: the disk is full (0 bytes free there). "
        "Free some space (or keep fewer checkpoints with training.keep_checkpoints), then "
        "continue the run with --resume"
    )


@pytest.mark.slow
def test_an_fsdp2_checkpoint_round_trips_weights_and_adamw_state(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from training.launch import launch_two

    script = Path(__file__).resolve().parent / "fsdp_checkpoint.py"
    done = launch_two(script, str(tiny_model_dir), str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)
    assert torch.equal(saved["saved"], saved["loaded"])  # the sharded weights came back
    continued, resumed = torch.load(tmp_path / "continued.pt", weights_only=True)
    assert torch.equal(continued, resumed)  # and AdamW's moments: the next step agrees
    # the checkpoint is a plain Hugging Face model folder, loadable without FSDP
    AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-1" / "model")


def test_a_symlink_named_as_a_checkpoint_is_neither_resumed_from_nor_removed(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from agile_llmenvs.weights import prune_checkpoints

    elsewhere = _save(tiny_model_dir, tmp_path / "elsewhere", step=9)  # a complete checkpoint
    kept = sorted(p.name for p in elsewhere.iterdir())
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint-9").symlink_to(elsewhere, target_is_directory=True)
    (run / "checkpoint-1").symlink_to(elsewhere, target_is_directory=True)
    _save(tiny_model_dir, run, step=2)
    newest = _save(tiny_model_dir, run, step=3)
    with caplog.at_level(logging.WARNING):
        found = find_checkpoint(run)
    assert found is not None
    assert found.directory == newest  # not the link's step 9
    assert f"ignoring {run / 'checkpoint-9'}: a symbolic link (to {elsewhere})" in caplog.text
    prune_checkpoints(run, keep=1)  # rotation: checkpoint-2 goes, the links stay
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-1", "checkpoint-3", "checkpoint-9"]
    assert sorted(p.name for p in elsewhere.iterdir()) == kept
    # a save of a step a link is named for replaces the link, not what it points at
    saved = _save(tiny_model_dir, run, step=1)
    assert not saved.is_symlink()
    assert (saved / "manifest.json").is_file()
    assert sorted(p.name for p in elsewhere.iterdir()) == kept
