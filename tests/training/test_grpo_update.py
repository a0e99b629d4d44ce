"""A GRPO update is the same whatever the micro-batch size and the number of processes."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from training.launch import launch_two
from training.update_cases import load_model, make_learner, synthetic_batch, update_delta

from agile_llmenvs.training.grpo import UpdateSettings, grpo_update

HERE = Path(__file__).resolve().parent
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")


def _relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])  # bnpo: see below
def test_micro_batches_give_the_whole_batch_update(tiny_model_dir: Path, loss_type: str) -> None:
    accelerator = Accelerator(cpu=True)
    settings = UpdateSettings(loss_type=loss_type, max_completion_tokens=20, beta=0.05)  # type: ignore[arg-type]
    whole, metrics = update_delta(tiny_model_dir, settings, accelerator=accelerator, reference=True)
    assert whole.abs().max() > 1e-4  # the update is not empty
    assert 0.0 < metrics["clip_fraction"] < 1.0  # the noisy ratios engage the clip
    for micro_batch_size in (1, 3):
        split = UpdateSettings(
            loss_type=loss_type,  # type: ignore[arg-type]
            max_completion_tokens=20,
            beta=0.05,
            micro_batch_size=micro_batch_size,
        )
        delta, split_metrics = update_delta(
            tiny_model_dir, split, accelerator=accelerator, reference=True
        )
        assert _relative_difference(delta, whole) < 1e-5, micro_batch_size
        for key in ("loss", "kl", "clip_fraction", "ratio_mean", "ratio_max", "entropy"):
            assert split_metrics[key] == pytest.approx(metrics[key], rel=1e-5), key


def test_loss_types_weigh_tokens_differently(tiny_model_dir: Path) -> None:
    accelerator = Accelerator(cpu=True)
    deltas = [
        update_delta(
            tiny_model_dir,
            UpdateSettings(loss_type=t, max_completion_tokens=20),  # type: ignore[arg-type]
            accelerator=accelerator,
        )[0]
        for t in LOSS_TYPES
    ]
    # on one process, one micro-batch, bnpo is dapo (both: 1 / this batch's tokens); the
    # others all differ
    assert _relative_difference(deltas[3], deltas[1]) < 1e-6
    for i, j in ((0, 1), (0, 2), (1, 2)):
        assert _relative_difference(deltas[i], deltas[j]) > 1e-2


def test_bnpo_normalises_each_micro_batch_as_trl_does(tiny_model_dir: Path) -> None:
    # TRL's bnpo: each micro-batch's token mean over the A accumulation steps, so one-row
    # micro-batches weigh a token 1 / (A * n_b) = 1 / (R * n_b) with A = R rows: grpo's
    # weights over the whole batch; micro-batches of 3 rows change the update
    accelerator = Accelerator(cpu=True)
    bnpo = UpdateSettings(loss_type="bnpo", max_completion_tokens=20, micro_batch_size=1)
    rows_of_one, _ = update_delta(tiny_model_dir, bnpo, accelerator=accelerator)
    grpo = UpdateSettings(loss_type="grpo", max_completion_tokens=20)
    whole_grpo, _ = update_delta(tiny_model_dir, grpo, accelerator=accelerator)
    assert _relative_difference(rows_of_one, whole_grpo) < 1e-5
    whole_bnpo, _ = update_delta(
        tiny_model_dir, dataclasses.replace(bnpo, micro_batch_size=None), accelerator=accelerator
    )
    rows_of_three, _ = update_delta(
        tiny_model_dir, dataclasses.replace(bnpo, micro_batch_size=3), accelerator=accelerator
    )
    assert _relative_difference(rows_of_three, whole_bnpo) > 1e-2


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher")
@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo", "grpo"])
def test_two_processes_give_the_one_process_update(
    tiny_model_dir: Path, tmp_path: Path, loss_type: str
) -> None:
    output = tmp_path / "delta"
    done = launch_two(HERE / "distributed_update.py", str(tiny_model_dir), loss_type, str(output))
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(f"{output}.rank{r}", weights_only=False) for r in (0, 1)]
    assert torch.equal(ranks[0]["delta"], ranks[1]["delta"])  # the ranks stay identical
    single = UpdateSettings(loss_type=loss_type, max_completion_tokens=20)  # type: ignore[arg-type]
    whole, metrics = update_delta(tiny_model_dir, single, accelerator=Accelerator(cpu=True))
    assert _relative_difference(ranks[0]["delta"], whole) < 1e-5
    assert ranks[0]["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher")
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_an_fsdp2_sharded_policy_gives_the_one_process_update(
    tiny_model_dir: Path, tmp_path: Path, loss_type: str
) -> None:
    # FSDP2 (fully_shard) over gloo on CPU: unequal shares, unequal micro-batch counts
    output = tmp_path / "delta.pt"
    done = launch_two(HERE / "fsdp_update.py", str(tiny_model_dir), loss_type, str(output))
    assert done.returncode == 0, done.stderr[-3000:]
    sharded = torch.load(output, weights_only=False)
    single = UpdateSettings(loss_type=loss_type, max_completion_tokens=20)  # type: ignore[arg-type]
    whole, metrics = update_delta(tiny_model_dir, single, accelerator=Accelerator(cpu=True))
    assert _relative_difference(sharded["delta"], whole) < 1e-5
    assert sharded["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher")
def test_an_fsdp2_policy_under_bf16_scores_itself_as_it_updates(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # the behaviour log-probs a sharded policy computes for itself run under the update's
    # autocast: the first pass's ratios are exactly 1 (fp32 self-scoring put them off by
    # bf16's rounding)
    output = tmp_path / "metrics.pt"
    done = launch_two(HERE / "fsdp_bf16_scoring.py", str(tiny_model_dir), str(output))
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = torch.load(output, weights_only=False)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["forward_dtype"] == "torch.bfloat16"  # generation computes as it trains


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher")
def test_hf_generation_on_an_fsdp2_policy_equals_the_unsharded_one(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    from agile_llmenvs.backends import HFBackend, SamplingParams

    done = launch_two(HERE / "fsdp_generate.py", str(tiny_model_dir), str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]  # no hang though the budgets differ
    backend = HFBackend.from_model(
        load_model(tiny_model_dir).eval(), AutoTokenizer.from_pretrained(tiny_model_dir)
    )
    prompts = ([5, 6, 7], [9, 10, 11, 12, 13])
    for rank, (prompt, budget) in enumerate(zip(prompts, (3, 9), strict=True)):
        sharded = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        params = SamplingParams(max_tokens=budget, temperature=1.0, seed=rank)
        plain = backend.generate([prompt], params)[0]
        assert sharded["ids"] == list(plain.token_ids)
        assert sharded["logps"] == pytest.approx(list(plain.logprobs), abs=1e-5)


def test_a_mini_batch_with_no_scored_token_still_moves_the_schedule(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    batch = synthetic_batch(model)
    # two mini-batches, rows 0-3 and 4-6 (7 rows split as evenly as rounding allows); the
    # second has no scored token: no optimizer step for it, but the schedule counts it
    action_BT = batch.action_mask_BT.clone()
    action_BT[4:] = False
    batch = dataclasses.replace(batch, action_mask_BT=action_BT)
    learner = make_learner(model, Accelerator(cpu=True))
    learner.scheduler = torch.optim.lr_scheduler.LambdaLR(
        learner.optimizer, lambda step: 1.0 - step / 10
    )
    settings = UpdateSettings(loss_type="dapo", max_completion_tokens=20, mini_batches=2)
    metrics = grpo_update(learner, batch, settings)
    assert metrics["grad_norm"] > 0.0  # the first mini-batch's step
    assert learner.scheduler.last_epoch == 2  # both planned steps counted
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.8)  # LR x (1 - 2/10)
