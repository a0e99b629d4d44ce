"""A learning step that would write NaN into the weights stops before the optimizer steps:
log-probs no sampled token can have (a vLLM server writes -9999 for -inf) and non-finite
gradients. The run ends non-zero with the weights as they were."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from accelerate import Accelerator
from training.update_cases import load_model, make_learner, synthetic_batch

from agile_llmenvs.cli import main
from agile_llmenvs.errors import NonFiniteUpdateError
from agile_llmenvs.training.generation import Sampler
from agile_llmenvs.training.grpo import UpdateSettings, grpo_update

ROOT = Path(__file__).resolve().parents[2]


def _weights(model: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("value", [-9999.0, -1e30, -math.inf, math.inf, 0.5])
def test_a_log_prob_no_sampled_token_can_have_stops_the_update(
    tiny_model_dir: Path, value: float
) -> None:
    model = load_model(tiny_model_dir)
    learner = make_learner(model, Accelerator(cpu=True))
    batch = synthetic_batch(model)
    sampling = batch.sampling_logps_BT.clone()
    sampling[3, 7] = value  # row 3's sampled tokens run from position 2 to 10, 4-5 aside
    assert batch.action_mask_BT[3, 7]
    batch = dataclasses.replace(batch, sampling_logps_BT=sampling)
    before = _weights(model)
    with pytest.raises(NonFiniteUpdateError) as raised:
        grpo_update(learner, batch, UpdateSettings())
    assert str(raised.value).startswith(
        f"the sampler recorded log-probs no sampled token can have (1 of this process's "
        f"sampled tokens, the first {sampling[3, 7]} (row 3, position 7); a sampled token's "
        "log-prob lies in [-100, 0]): its ratio would be inf and the update NaN. Stopped "
        "before learning from them: the weights and the last checkpoint are as they were."
    )
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))


def test_a_non_finite_gradient_stops_the_step_before_the_optimizer(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    learner = make_learner(model, Accelerator(cpu=True))
    batch = synthetic_batch(model)
    advantages = batch.advantages_B.clone()
    advantages[2] = math.nan  # as a reward no check caught would make it
    before = _weights(model)
    with pytest.raises(
        NonFiniteUpdateError, match=r"^the gradient norm of this optimizer step is nan"
    ):
        grpo_update(learner, dataclasses.replace(batch, advantages_B=advantages), UpdateSettings())
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))


def test_a_run_whose_sampler_answers_minus_9999_exits_2_with_its_weights_finite(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The sampler's log-probs as a vLLM server's that reports -9999 for one token from the
    second step on: the run used to train on (loss NaN), save NaN weights and exit 0."""
    real = Sampler.__call__
    calls = []

    def minus_9999(self: Sampler, contexts: list[list[int]]) -> Any:
        out = real(self, contexts)
        calls.append(1)
        if len(calls) >= 2:  # one call a step (one turn): from the second step on
            ids, logps = out[0]
            out[0] = (ids, (-9999.0, *logps[1:]))
        return out

    monkeypatch.setattr(Sampler, "__call__", minus_9999)
    data = yaml.safe_load((ROOT / "manifests" / "quickstart.yaml").read_text())
    data["env"]["dataset_path"] = str(ROOT / "manifests" / "data" / "digits.jsonl")
    data["env"]["rubric_file_path"] = str(ROOT / "manifests" / "rubrics" / "digits.py")
    data["model"] = {"path": str(tiny_model_dir)}
    out = tmp_path / "run"
    data["training"].update(
        max_steps=3, save_every=1, batch_size=2, group_size=4, output_dir=str(out)
    )
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "error: the sampler recorded log-probs no sampled token can have (1 of this " in err
    # step 2 stopped before learning: step 1's row and checkpoint stay, its weights finite
    assert [line.split(",")[0] for line in (out / "metrics.csv").read_text().splitlines()] == [
        "step",
        "1",
    ]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    from safetensors.torch import load_file

    weights = load_file(out / "checkpoint-1" / "model" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())
