"""The learning-rate schedule, weight decay groups, and the fp32 master-weights rule."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from agile_llmenvs.errors import AgileLLMEnvsError
from agile_llmenvs.specs import RunManifest
from agile_llmenvs.training.policy import (
    check_master_weights,
    lr_factor,
    make_optimizer,
    make_scheduler,
)


@pytest.mark.parametrize(
    ("schedule", "step", "expected"),
    [
        # warmup 4 of 10 steps: (s + 1) / 4 whatever the schedule
        ("cosine", 0, 0.25),
        ("linear", 2, 0.75),
        ("constant", 3, 1.0),
        ("constant", 9, 1.0),
        # after it p = (s - 4) / 6: linear 1 - p, cosine (1 + cos(pi p)) / 2
        ("linear", 4, 1.0),
        ("linear", 7, 0.5),
        ("linear", 10, 0.0),
        ("cosine", 7, 0.5),
        ("cosine", 5, (1 + math.cos(math.pi / 6)) / 2),
    ],
)
def test_lr_factor_by_hand(schedule: str, step: int, expected: float) -> None:
    factor = lr_factor(schedule, step, warmup_steps=4, total_steps=10)  # type: ignore[arg-type]
    assert factor == pytest.approx(expected)


def test_scheduler_steps_the_optimizer_rate() -> None:
    layer = torch.nn.Linear(2, 2)
    optimizer = make_optimizer(layer, learning_rate=0.1, weight_decay=0.0)
    scheduler = make_scheduler(optimizer, "linear", warmup_steps=2, total_steps=6)
    rates = []
    for _ in range(6):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    # warmup 0.05, 0.1; then 1 - (s - 2) / 4 for s = 2..5
    assert rates == pytest.approx([0.05, 0.1, 0.1, 0.075, 0.05, 0.025])


def test_weight_decay_skips_biases_and_norms() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    optimizer = make_optimizer(model, learning_rate=1e-3, weight_decay=0.1)
    decayed, plain = optimizer.param_groups
    assert [p.shape for p in decayed["params"]] == [torch.Size([4, 3])]
    assert decayed["weight_decay"] == 0.1
    assert [p.shape for p in plain["params"]] == [torch.Size([4])] * 3  # bias, norm w and b
    assert plain["weight_decay"] == 0.0


def test_half_precision_weights_are_refused() -> None:
    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    with pytest.raises(AgileLLMEnvsError, match=r"torch.bfloat16: the optimizer needs fp32"):
        check_master_weights(model)
    check_master_weights(torch.nn.Linear(2, 2))  # fp32 passes


def _manifest(**changes: object) -> dict[str, object]:
    return {
        "env": {
            "env_type": "dataset",
            "objective": "sft",
            "dataset_path": "manifests/data/digits_sft.jsonl",
            "response_column": "response",
        },
        "training": {"algorithm": "sft"},
        **changes,
    }


def test_a_bf16_model_without_lora_fails_at_load_naming_what_to_set() -> None:
    with pytest.raises(ValidationError, match=r"model.dtype: training bfloat16 weights") as info:
        RunManifest.model_validate(_manifest(model={"dtype": "bfloat16"}))
    assert "`model.dtype: float32` and `training.mixed_precision: bf16`" in str(info.value)
    lora = _manifest(model={"dtype": "bfloat16"})
    lora["training"] = {"algorithm": "sft", "lora": {"r": 4}}
    RunManifest.model_validate(lora)  # adapters on a bf16 base are fine


def test_a_plain_fp32_model_steps_with_the_fused_kernel_as_adamw_says() -> None:
    """AdamW's first step by hand: m = (1 - b1) g and v = (1 - b2) g^2, bias-corrected back to
    g and g^2, so each weight moves by lr * g / (|g| + eps), after the decoupled decay
    w * (1 - lr * wd); the bias takes no decay."""
    layer = torch.nn.Linear(2, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, -2.0], [0.5, 0.0]]))
        layer.bias.copy_(torch.tensor([0.25, -0.75]))
    optimizer = make_optimizer(layer, learning_rate=0.1, weight_decay=0.5)
    assert all(group["fused"] for group in optimizer.param_groups)
    layer.weight.grad = torch.tensor([[2.0, -0.5], [0.0, 4.0]])
    layer.bias.grad = torch.tensor([-1.0, 3.0])
    optimizer.step()
    eps = 1e-8
    weight = [  # row by row
        1.0 * 0.95 - 0.1 * 2 / (2 + eps),
        -2.0 * 0.95 + 0.1 * 0.5 / (0.5 + eps),
        0.5 * 0.95 - 0.0,
        0.0 * 0.95 - 0.1 * 4 / (4 + eps),
    ]
    bias = [0.25 + 0.1 * 1 / (1 + eps), -0.75 - 0.1 * 3 / (3 + eps)]
    assert layer.weight.flatten().tolist() == pytest.approx(weight, abs=1e-6)
    assert layer.bias.tolist() == pytest.approx(bias, abs=1e-6)


def test_half_precision_parameters_keep_the_default_adamw() -> None:
    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    optimizer = make_optimizer(model, learning_rate=0.1, weight_decay=0.0)
    assert not any(group["fused"] for group in optimizer.param_groups)
