"""LoRA through peft: only the adapters train, the base with adapters off is the reference,
checkpoints hold (and restore) the adapters, and the merged weights equal the adapted model."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from training.launch import launch_two

from agile_llmenvs.errors import CheckpointError, OptionalDependencyError
from agile_llmenvs.specs import LoRASpec, RunManifest
from agile_llmenvs.training import train_dpo, train_grpo, train_sft
from agile_llmenvs.training.grpo import setup as grpo_setup
from agile_llmenvs.training.policy import AdaptersOffReference, apply_lora, reference_model
from agile_llmenvs.training.supervised import loop as supervised_loop
from agile_llmenvs.weights import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    adapter_rank,
    merged_weights,
)

pytest.importorskip("peft")

LORA = {"r": 4, "alpha": 8.0}
HERE = Path(__file__).resolve().parent


def _load(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


class _Policies:
    """Records every policy ``prepare_policy`` builds (the real one runs)."""

    def __init__(self, module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.models: list[Any] = []
        real = module.prepare_policy

        def recording(*args: Any, **kwargs: Any) -> Any:
            prepared = real(*args, **kwargs)
            learner = prepared[0]
            self.models.append(learner.accelerator.unwrap_model(learner.model))
            return prepared

        monkeypatch.setattr(module, "prepare_policy", recording)


def _split(policy: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base weights under the base model's names, adapter weights) of a peft model."""
    base, adapters = {}, {}
    for name, param in policy.get_base_model().named_parameters():
        if ".lora_" in name:
            adapters[name] = param.detach().clone()
        else:
            base[name.replace(".base_layer.", ".")] = param.detach().clone()
    return base, adapters


def _assert_only_adapters_trained(policy: Any, model_dir: Path) -> None:
    base, adapters = _split(policy)
    initial = dict(_load(model_dir).named_parameters())
    assert sorted(base) == sorted(initial)
    for name, weight in base.items():
        assert torch.equal(weight, initial[name]), name  # bit-identical
    assert all(not p.requires_grad for n, p in policy.named_parameters() if ".lora_" not in n)
    lora_b = [weight for name, weight in adapters.items() if ".lora_B." in name]
    assert len(lora_b) == 7 * 2  # every linear layer of both decoder blocks
    assert all(weight.abs().sum() > 0 for weight in lora_b)  # B starts at zero


def test_lora_sft_lowers_the_loss_training_only_the_adapters(
    make_manifest: Callable[..., RunManifest],
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policies = _Policies(supervised_loop, monkeypatch)
    result = train_sft(make_manifest("sft_digits_lora.yaml", max_steps=30))
    losses = [row["loss"] for row in result.metrics]
    # the tied embedding stays frozen, so the tiny model's loss plateaus near 5.3 nats
    assert sum(losses[-5:]) < 0.95 * sum(losses[:5]), losses
    _assert_only_adapters_trained(policies.models[0], tiny_model_dir)
    saved = sorted(path.name for path in (result.checkpoint_dir / "model").iterdir())
    assert "adapter_model.safetensors" in saved
    assert "model.safetensors" not in saved


def test_lora_grpo_trains_the_adapters_against_the_base_model(
    make_manifest: Callable[..., RunManifest],
    dense_env: dict[str, Any],
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policies = _Policies(grpo_setup, monkeypatch)
    manifest = make_manifest(
        "quickstart.yaml",
        env=dense_env,
        max_steps=3,
        batch_size=2,
        group_size=4,
        max_new_tokens=4,
        learning_rate=0.05,
        beta=0.1,
        lora=LORA,
    )
    result = train_grpo(manifest)
    kls = [row["kl"] for row in result.metrics]
    assert kls[0] == 0.0  # the adapters start at zero: policy and reference agree exactly
    assert kls[2] > 0.0
    _assert_only_adapters_trained(policies.models[0], tiny_model_dir)


def test_lora_dpo_measures_the_adapters_against_the_base_model(
    make_manifest: Callable[..., RunManifest],
) -> None:
    result = train_dpo(
        make_manifest("dpo_digits.yaml", max_steps=20, learning_rate=0.02, lora=LORA)
    )
    margins = [row["margin"] for row in result.metrics]
    assert margins[0] == 0.0  # zero adapters: the policy is exactly its reference
    assert min(margins[-5:]) > 0.15, margins  # frozen embeddings: smaller than full DPO's
    assert result.metrics[-1]["loss"] < result.metrics[0]["loss"]


def test_lora_resume_restores_the_adapters(
    make_manifest: Callable[..., RunManifest], tmp_path: Path
) -> None:
    settings = {"max_steps": 4, "lora": LORA}
    straight_dir = str(tmp_path / "a")
    straight = train_sft(make_manifest("sft_digits.yaml", output_dir=straight_dir, **settings))
    resumed_dir = str(tmp_path / "b")
    train_sft(make_manifest("sft_digits.yaml", output_dir=resumed_dir, max_steps=2, lora=LORA))
    resumed = train_sft(
        make_manifest("sft_digits.yaml", output_dir=resumed_dir, **settings), resume=True
    )
    assert [row["step"] for row in resumed.metrics] == [3.0, 4.0]
    for key in ("loss", "grad_norm"):  # same rows, adapters and optimizer state
        assert [r[key] for r in resumed.metrics] == pytest.approx(
            [r[key] for r in straight.metrics[2:]], rel=1e-5
        )


def test_resuming_with_another_lora_setting_says_so(
    make_manifest: Callable[..., RunManifest], tmp_path: Path
) -> None:
    train_sft(make_manifest("sft_digits.yaml", max_steps=1))
    lora = make_manifest("sft_digits.yaml", max_steps=2, lora=LORA)
    with pytest.raises(CheckpointError) as raised:  # the run's manifest says so first
        train_sft(lora, resume=True)
    assert str(raised.value).startswith(
        f"cannot resume {tmp_path / 'run'}: the run there has training.lora None, this "
        "manifest {'r': 4, 'alpha': 8.0, "
    )
    (tmp_path / "run" / "manifest.yaml").unlink()  # a run from before runs stored it
    with pytest.raises(CheckpointError) as raised:
        train_sft(lora, resume=True)
    directory = tmp_path / "run" / "checkpoint-1" / "model"
    assert str(raised.value) == (
        f"the checkpoint in {directory} holds full weights, but this run trains LoRA "
        "adapters: resume with the `training.lora` setting it was saved with"
    )


def test_lora_without_peft_names_the_extra(
    make_manifest: Callable[..., RunManifest], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(OptionalDependencyError) as raised:
        train_sft(make_manifest("sft_digits_lora.yaml", max_steps=1))
    assert str(raised.value) == (
        "The package 'peft' is needed for LoRA training (training.lora) but is not installed; "
        'run: pip install "agile-llmenvs[train]"'
    )


def _nonzero_adapters(model_dir: Path) -> Any:
    policy = apply_lora(_load(model_dir), LoRASpec(**LORA))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if ".lora_B." in name:
                param.normal_(std=0.1)
    return policy


def test_reference_is_the_base_model_with_adapters_off(tiny_model_dir: Path) -> None:
    policy = _nonzero_adapters(tiny_model_dir).train()
    reference = reference_model(policy, "cpu")
    assert isinstance(reference, AdaptersOffReference)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    base_logits = _load(tiny_model_dir)(input_ids=ids).logits
    assert torch.allclose(reference(input_ids=ids).logits, base_logits, atol=1e-6)
    assert not torch.allclose(policy(input_ids=ids).logits, base_logits, atol=1e-3)
    assert policy.training  # the reference put the policy's mode back


def test_merged_weights_load_into_the_plain_model(tiny_model_dir: Path) -> None:
    policy = _nonzero_adapters(tiny_model_dir).eval()
    plain = _load(tiny_model_dir)
    weights = merged_weights(policy)
    assert sorted(weights) == sorted(name for name, _ in plain.named_parameters())
    plain.load_state_dict(weights, strict=False)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, policy(input_ids=ids).logits, atol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher")
def test_fsdp_adapters_are_written_whole_in_peft_layout(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    folder = tmp_path / "sync"
    done = launch_two(HERE / "sharded_adapters.py", str(tiny_model_dir), str(folder))
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in folder.iterdir()) == [ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE]
    written = load_file(str(folder / ADAPTER_WEIGHTS_FILE))
    expected = load_file(str(tmp_path / "expected" / ADAPTER_WEIGHTS_FILE))
    assert set(written) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name
    assert adapter_rank(folder) == 4
