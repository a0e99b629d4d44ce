"""Two gloo processes under ``accelerate launch``: disjoint tasks, identical parameters."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from training.launch import TWO_PROCESSES, accelerate_launch, launch_two

from agile_llmenvs.specs import LLMEnvSpec, ModelSpec, RunManifest, TrainingSpec
from agile_llmenvs.specs.manifest import dump_manifest
from agile_llmenvs.training.run import read_metrics
from agile_llmenvs.weights import find_checkpoint

HERE = Path(__file__).resolve().parent
MANIFEST = HERE.parents[1] / "manifests" / "quickstart.yaml"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher")
def test_two_ranks_draw_disjoint_tasks_and_stay_in_sync(tmp_path: Path) -> None:
    done = launch_two(HERE / "distributed_grpo.py", str(MANIFEST), str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    # 2 steps x 2 groups per rank; the digits file has 10 rows, sharded between the ranks
    assert [len(r["rows"]) for r in ranks] == [4, 4]
    assert not set(ranks[0]["rows"]) & set(ranks[1]["rows"])
    assert ranks[0]["params"] == ranks[1]["params"]
    assert ranks[0]["grad_steps"] == 2


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher")
def test_fsdp_trains_as_data_parallel_does(tmp_path: Path) -> None:
    runs = {}
    for mode in ("ddp", "fsdp"):
        out = tmp_path / mode
        args = [str(MANIFEST), str(out)] + (["fsdp"] if mode == "fsdp" else [])
        done = launch_two(HERE / "distributed_grpo.py", *args)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[mode] = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    ddp, fsdp = runs["ddp"], runs["fsdp"]
    assert [r["rows"] for r in fsdp] == [r["rows"] for r in ddp]  # the same tasks
    assert fsdp[0]["params"] == fsdp[1]["params"]  # the gathered weights agree
    for ours, theirs in zip(fsdp[0]["metrics"], ddp[0]["metrics"], strict=True):
        assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-6)
    for ours, theirs in zip(fsdp[0]["params"], ddp[0]["params"], strict=True):
        assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher")
def test_the_train_command_shards_checkpoints_and_resumes_under_fsdp(
    make_manifest: Callable[..., RunManifest], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    path = tmp_path / "fsdp.yaml"
    settings = {"batch_size": 4, "group_size": 4, "fsdp": True, "output_dir": str(out)}
    dump_manifest(make_manifest("quickstart.yaml", max_steps=2, **settings), path)
    done = accelerate_launch(TWO_PROCESSES, "-m", "agile_llmenvs", "train", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    dump_manifest(make_manifest("quickstart.yaml", max_steps=3, **settings), path)
    resumed = accelerate_launch(
        TWO_PROCESSES, "-m", "agile_llmenvs", "train", str(path), "--resume"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "trained 3 steps" in resumed.stdout
    rows = read_metrics(out / "metrics.csv")
    assert [int(row["step"]) for row in rows] == [1, 2, 3]
    checkpoint = find_checkpoint(out)
    assert checkpoint is not None
    assert (checkpoint.step, checkpoint.world_size) == (3, 2)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(checkpoint.directory / "model")  # whole, unsharded


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_accelerates_fsdp2_plugin_trains_and_checkpoints(
    make_manifest: Callable[..., RunManifest], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    path = tmp_path / "plugin.yaml"
    dump_manifest(
        make_manifest(
            "quickstart.yaml", max_steps=2, batch_size=4, group_size=4, output_dir=str(out)
        ),
        path,
    )
    config = HERE.parents[1] / "manifests" / "accelerate" / "fsdp2.yaml"
    done = accelerate_launch(
        ["--config_file", str(config)], "-m", "agile_llmenvs", "train", str(path), cpu=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = find_checkpoint(out)
    assert checkpoint is not None
    assert checkpoint.step == 2


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher")
def test_sft_under_fsdp_follows_data_parallel(
    make_manifest: Callable[..., RunManifest], tmp_path: Path
) -> None:
    losses = {}
    for fsdp in (False, True):
        out = tmp_path / f"fsdp-{fsdp}"
        path = tmp_path / f"sft-{fsdp}.yaml"
        manifest = make_manifest("sft_digits.yaml", max_steps=3, fsdp=fsdp, output_dir=str(out))
        dump_manifest(manifest, path)
        done = accelerate_launch(TWO_PROCESSES, "-m", "agile_llmenvs", "train", str(path))
        assert done.returncode == 0, done.stderr[-3000:]
        losses[fsdp] = [row["loss"] for row in read_metrics(out / "metrics.csv")]
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher")
def test_multi_turn_grpo_under_fsdp_pairs_the_generate_calls(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # episodes of 1-3 turns by task seed: the processes make different numbers of generate
    # calls, which a sharded model can only serve paired
    monkeypatch.setenv("PYTHONPATH", str(HERE.parent))
    metrics = {}
    for fsdp in (False, True):
        out = tmp_path / f"fsdp-{fsdp}"
        manifest = RunManifest(
            env=LLMEnvSpec(env_type="rollout", entrypoint="echo_envs:SeededTurnsEnv", max_turns=3),
            model=ModelSpec(path=str(tiny_model_dir)),
            training=TrainingSpec(
                algorithm="grpo",
                max_steps=2,
                batch_size=4,
                group_size=2,
                max_new_tokens=4,
                fsdp=fsdp,
                output_dir=str(out),
            ),
        )
        path = tmp_path / f"turns-{fsdp}.yaml"
        dump_manifest(manifest, path)
        done = accelerate_launch(TWO_PROCESSES, "-m", "agile_llmenvs", "train", str(path))
        assert done.returncode == 0, done.stderr[-3000:]
        metrics[fsdp] = [(r["reward_mean"], r["loss"]) for r in read_metrics(out / "metrics.csv")]
    for sharded, plain in zip(metrics[True], metrics[False], strict=True):
        assert sharded == pytest.approx(plain, rel=1e-4, abs=1e-6)
