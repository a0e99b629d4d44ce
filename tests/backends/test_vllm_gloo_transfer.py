"""Weight syncs streamed over gloo (``weight_transfer="gloo"``): vLLM's weight-transfer routes
with the ``agile_gloo`` engine, on real ``vllm serve`` processes (``vllm_server`` marker), and
the layer grouping and metadata they rest on (no server)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fakes import digit_messages

from agile_llmenvs.backends import HFBackend, SamplingParams, VLLMServerBackend
from agile_llmenvs.backends.vllm_launch import VLLMServerProcess
from agile_llmenvs.errors import GenerationServerError
from agile_llmenvs.weights import TensorMeta, layer_groups, local_weights, weight_metas

pytest.importorskip("aiohttp")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def perturbed(model: Any, seed: int, scale: float = 0.05) -> Any:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    return model


def test_layer_groups_follow_the_outermost_index() -> None:
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.experts.3.w1",
        "model.layers.1.input_layernorm.weight",
        "model.layers.10.input_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    metas = [TensorMeta(n, torch.float32, (1,)) for n in names]
    assert [[m.name for m in run] for run in layer_groups(metas)] == [
        ["model.embed_tokens.weight"],
        ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.3.w1"],
        ["model.layers.1.input_layernorm.weight"],
        ["model.layers.10.input_layernorm.weight"],
        ["model.norm.weight"],
        ["lm_head.weight"],
    ]
    assert metas[0].dtype_name == "float32"


def test_weight_metas_match_the_streamed_tensors(tiny_model_dir: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    lora = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["q_proj"]))
    for model in (base, lora):
        streamed = [(n, t.dtype, tuple(t.shape)) for n, t in local_weights(model, whole=True)]
        assert weight_metas(model) == streamed
    assert [name for name, _, _ in weight_metas(lora)] == [n for n, _ in base.named_parameters()]


def test_the_manifest_chooses_the_transfer(tmp_path: Path, tiny_model_dir: Path) -> None:
    from pydantic import ValidationError

    from agile_llmenvs.specs import VLLMServerSpec
    from agile_llmenvs.training.generation import server_backend

    spec = VLLMServerSpec(urls=["http://127.0.0.1:8000"])
    assert (spec.weight_transfer, spec.transfer_host) == ("files", "127.0.0.1")
    assert server_backend(spec, tiny_model_dir, tmp_path).weight_transfer == "files"
    spec = VLLMServerSpec(urls=spec.urls, weight_transfer="gloo", transfer_host="10.0.0.5")
    backend = server_backend(spec, tiny_model_dir, tmp_path)
    assert (backend.weight_transfer, backend.transfer_host) == ("gloo", "10.0.0.5")
    with pytest.raises(ValidationError, match="weight_transfer"):
        VLLMServerSpec(urls=spec.urls, weight_transfer="nccl")
    with pytest.raises(ValueError, match="weight_transfer must be 'files' or 'gloo'"):
        VLLMServerBackend(spec.urls, tokenizer=tiny_model_dir, weight_transfer="nccl")  # type: ignore[arg-type]
    assert VLLMServerProcess(tiny_model_dir, python="python").command()[-2:] != [
        "--weight-transfer-config",
        '{"backend": "agile_gloo"}',
    ]
    assert VLLMServerProcess(tiny_model_dir, python="python", weight_transfer="gloo").command()[
        -2:
    ] == ["--weight-transfer-config", '{"backend": "agile_gloo"}']


@pytest.mark.vllm_server
def test_streamed_sync_serves_the_policy_on_every_server(
    vllm_server_factory: Callable[..., VLLMServerProcess], vllm_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    servers = [vllm_server_factory(weight_transfer="gloo") for _ in range(2)]
    backends = [VLLMServerBackend(s.url, tokenizer=vllm_model_dir) for s in servers]
    both = VLLMServerBackend(
        [s.url for s in servers], tokenizer=vllm_model_dir, weight_transfer="gloo"
    )
    try:
        prompts = [both.encode_chat(m) for m in digit_messages(*range(4))]
        before = [g.token_ids for g in backends[0].generate(prompts, GREEDY)]
        original = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
        policy = perturbed(copy.deepcopy(original), seed=1)
        want = HFBackend.from_model(policy, both.tokenizer).generate(prompts, GREEDY)

        seconds = both.sync_weights(policy)

        assert 0 < seconds < 30
        assert both.version == 1
        assert not list(Path(both.weights_folder(1)).parent.glob("*"))  # nothing on disk
        for backend in backends:
            after = backend.generate(prompts, GREEDY)
            assert [g.token_ids for g in after] == [g.token_ids for g in want]
            for got, expected in zip(after, want, strict=True):
                assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-4)
        assert [g.token_ids for g in want] != before

        both.sync_weights(original, version=0)  # a second sync reuses the group
        for backend in backends:
            assert [g.token_ids for g in backend.generate(prompts, GREEDY)] == before
    finally:
        for backend in (*backends, both):
            backend.close()


@pytest.mark.vllm_server
def test_a_server_without_the_gloo_engine_is_named(
    vllm_server: VLLMServerProcess, vllm_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    backend = VLLMServerBackend(vllm_server.url, tokenizer=vllm_model_dir, weight_transfer="gloo")
    try:
        with pytest.raises(GenerationServerError, match="agile_gloo") as raised:
            backend.sync_weights(AutoModelForCausalLM.from_pretrained(vllm_model_dir))
        assert raised.value.url == vllm_server.url
        assert backend.version == 0
    finally:
        backend.close()


@pytest.mark.slow
@pytest.mark.vllm_server
@pytest.mark.parametrize("mode", ["fsdp", "fsdp-lora"])
def test_two_processes_stream_a_sharded_policy(
    vllm_server_factory: Callable[..., VLLMServerProcess],
    vllm_model_dir: Path,
    tmp_path: Path,
    mode: str,
) -> None:
    import json

    from training.launch import launch_two

    if mode == "fsdp-lora":
        pytest.importorskip("peft")
    server = vllm_server_factory(weight_transfer="gloo")
    script = Path(__file__).resolve().parents[1] / "training" / "sharded_gloo_sync.py"
    done = launch_two(script, str(vllm_model_dir), mode, server.url, str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "got.json").read_text()) == json.loads(
        (tmp_path / "want.json").read_text()
    )
    assert [(tmp_path / f"version-{r}").read_text() for r in (0, 1)] == ["1", "1"]
