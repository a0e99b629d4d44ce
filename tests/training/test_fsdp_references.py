"""A sharded policy with a frozen reference (GRPO's KL term, DPO) or LoRA adapters takes the
data-parallel update: two SGD updates on unequal shares, 2 gloo processes each way."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from training.launch import TWO_PROCESSES, accelerate_launch, launch_two

from agile_llmenvs.specs import RunManifest
from agile_llmenvs.specs.manifest import dump_manifest
from agile_llmenvs.training.run import read_metrics
from agile_llmenvs.weights import find_checkpoint

HERE = Path(__file__).resolve().parent


def _run(case: str, mode: str, model_dir: Path, tmp_path: Path) -> dict:
    output = tmp_path / f"{case}-{mode}.pt"
    done = launch_two(HERE / "sharded_updates.py", case, mode, str(model_dir), str(output))
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(output, weights_only=False)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher")
@pytest.mark.parametrize("case", ["grpo_kl", "grpo_kl_idle", "dpo", "lora_grpo"])
def test_a_sharded_policy_takes_data_parallels_update(
    tiny_model_dir: Path, tmp_path: Path, case: str
) -> None:
    plain = _run(case, "ddp", tiny_model_dir, tmp_path)
    sharded = _run(case, "fsdp", tiny_model_dir, tmp_path)
    delta, expected = sharded["delta"], plain["delta"]
    assert delta.shape == expected.shape
    assert float((delta - expected).abs().max() / expected.abs().max()) < 1e-5
    for ours, theirs in zip(sharded["metrics"], plain["metrics"], strict=True):
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), key
    first, second = plain["metrics"]
    if case == "dpo":
        # the first update starts at the reference: every margin is 0, the loss log 2
        assert (first["margin"], first["loss"]) == (0.0, pytest.approx(0.693147, abs=1e-6))
        assert second["margin"] > 0.0
    else:
        assert first["kl"] == 0.0
        assert second["kl"] > 0.0
    if case == "lora_grpo":
        # only the adapters move: lora_B in the first update (it starts at 0), then lora_A
        assert 0 < int((expected != 0).sum()) < expected.numel() // 10
    else:
        assert sharded["reference"] == {
            "sharded": True,
            "local_shapes_match": True,
            "frozen": True,
            "eval": True,
            "unmoved": True,
        }


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher")
def test_the_train_command_runs_lora_with_a_kl_term_sharded_as_data_parallel_does(
    make_manifest: Callable[..., RunManifest], tmp_path: Path
) -> None:
    # the sharded LoRA policy generates (HF), learns against its adapters-off reference,
    # checkpoints its adapters and resumes from them
    settings = {"batch_size": 4, "group_size": 4, "beta": 0.05, "lora": {"r": 4}}
    metrics = {}
    for fsdp in (False, True):
        out = tmp_path / f"fsdp-{fsdp}"
        path = tmp_path / f"lora-{fsdp}.yaml"
        manifest = make_manifest(
            "quickstart.yaml", max_steps=3, fsdp=fsdp, output_dir=str(out), **settings
        )
        dump_manifest(manifest, path)
        done = accelerate_launch(TWO_PROCESSES, "-m", "agile_llmenvs", "train", str(path))
        assert done.returncode == 0, done.stderr[-3000:]
        metrics[fsdp] = [
            (r["reward_mean"], r["loss"], r["kl"], r["grad_norm"])
            for r in read_metrics(out / "metrics.csv")
        ]
    for sharded, plain in zip(metrics[True], metrics[False], strict=True):
        assert sharded == pytest.approx(plain, rel=1e-4, abs=1e-6)
    out = tmp_path / "fsdp-True"
    path = tmp_path / "lora-True.yaml"
    dump_manifest(
        make_manifest("quickstart.yaml", max_steps=4, fsdp=True, output_dir=str(out), **settings),
        path,
    )
    resumed = accelerate_launch(
        TWO_PROCESSES, "-m", "agile_llmenvs", "train", str(path), "--resume"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "trained 4 steps (1 now, resumed at step 3)" in resumed.stdout
    checkpoint = find_checkpoint(out)
    assert checkpoint is not None
    assert checkpoint.step == 4
    assert (checkpoint.directory / "model" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher")
def test_the_train_command_runs_dpo_sharded_as_data_parallel_does(
    make_manifest: Callable[..., RunManifest], tmp_path: Path
) -> None:
    losses = {}
    for fsdp in (False, True):
        out = tmp_path / f"fsdp-{fsdp}"
        path = tmp_path / f"dpo-{fsdp}.yaml"
        dump_manifest(
            make_manifest("dpo_digits.yaml", max_steps=3, fsdp=fsdp, output_dir=str(out)), path
        )
        done = accelerate_launch(TWO_PROCESSES, "-m", "agile_llmenvs", "train", str(path))
        assert done.returncode == 0, done.stderr[-3000:]
        losses[fsdp] = [(r["loss"], r["margin"]) for r in read_metrics(out / "metrics.csv")]
    assert losses[True][0][0] == pytest.approx(0.693147, abs=1e-5)  # log 2: at the reference
    for sharded, plain in zip(losses[True], losses[False], strict=True):
        assert sharded == pytest.approx(plain, rel=1e-4, abs=1e-6)
