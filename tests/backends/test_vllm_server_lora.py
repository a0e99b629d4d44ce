"""A LoRA policy synced to real ``vllm serve`` processes as its adapters only
(``lora_sync="adapters"``): the server then generates what the trainer's peft model does, from
a folder of adapter tensors alone; a server that cannot serve them is named, with the fix.

The LoRA server (:func:`~vllm_servers.vllm_lora_server`) is shared by the session: adapter
syncs leave its base weights as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fakes import digit_messages
from vllm_servers import LORA_SERVER_RANK

from agile_llmenvs.backends import HFBackend, SamplingParams, VLLMServerBackend
from agile_llmenvs.backends.vllm_launch import VLLMServerProcess
from agile_llmenvs.errors import GenerationServerError
from agile_llmenvs.specs import LoRASpec, VLLMServerSpec

pytest.importorskip("aiohttp")
pytest.importorskip("peft")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]


def lora_policy(model_dir: Path, *, r: int, seed: int) -> Any:
    """The model under fresh adapters of rank ``r``, with ``B`` random (peft starts it at
    zero, which would change nothing)."""
    from transformers import AutoModelForCausalLM

    from agile_llmenvs.training.policy import apply_lora

    policy = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir), LoRASpec(r=r))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return policy.eval()


def greedy_ids(backend: Any, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    return [g.token_ids for g in backend.generate(prompts, GREEDY)]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


@pytest.fixture
def lora_backend(
    vllm_lora_server: VLLMServerProcess, vllm_model_dir: Path
) -> Iterator[VLLMServerBackend]:
    backend = VLLMServerBackend(
        vllm_lora_server.url, tokenizer=vllm_model_dir, lora_sync="adapters"
    )
    yield backend
    backend.close()


def test_the_manifest_syncs_adapters_by_default(tmp_path: Path, vllm_model_dir: Path) -> None:
    from agile_llmenvs.training.generation import server_backend

    spec = VLLMServerSpec(urls=["http://127.0.0.1:8000"])
    assert spec.lora_sync == "adapters"
    backend = server_backend(spec, vllm_model_dir, tmp_path)
    assert backend.lora_sync == "adapters"
    assert VLLMServerBackend(spec.urls, tokenizer=vllm_model_dir).lora_sync == "merged"
    with pytest.raises(ValueError, match="lora_sync must be 'adapters' or 'merged'"):
        VLLMServerBackend(spec.urls, tokenizer=vllm_model_dir, lora_sync="both")  # type: ignore[arg-type]


@pytest.mark.vllm_server
def test_an_adapters_sync_serves_the_lora_policy(
    lora_backend: VLLMServerBackend, vllm_model_dir: Path
) -> None:
    prompts = [lora_backend.encode_chat(m) for m in digit_messages(*range(4))]
    base = greedy_ids(lora_backend, prompts)
    policy = lora_policy(vllm_model_dir, r=LORA_SERVER_RANK, seed=1)
    model_bytes = sum(
        p.numel() * p.element_size() for p in policy.get_base_model().parameters()
    ) - sum(p.numel() * p.element_size() for n, p in policy.named_parameters() if "lora_" in n)
    folders = []
    for version, seed in [(1, 1), (2, 2)]:
        if seed != 1:
            policy = lora_policy(vllm_model_dir, r=LORA_SERVER_RANK, seed=seed)
        seconds = lora_backend.sync_weights(policy)
        assert 0 < seconds < 30
        assert lora_backend.version == version
        folder = lora_backend.weights_folder(version)
        folders.append(folder)
        # only the adapters went: peft's two files, a small share of the model's bytes
        assert sorted(p.name for p in folder.iterdir()) == ADAPTER_FILES
        assert folder_bytes(folder) < model_bytes / 5
        served = lora_backend.generate(prompts, GREEDY)
        want = HFBackend.from_model(policy, lora_backend.tokenizer).generate(prompts, GREEDY)
        assert [g.token_ids for g in served] == [g.token_ids for g in want]
        assert [g.token_ids for g in served] != base
        for got, expected in zip(served, want, strict=True):
            assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-3)
    lora_backend._sync.settle()  # the previous sync's folder is removed on a thread
    assert not folders[0].exists()


@pytest.mark.vllm_server
def test_an_adapters_sync_to_a_server_without_lora_names_it_and_the_fix(
    vllm_server: VLLMServerProcess, vllm_model_dir: Path
) -> None:
    backend = VLLMServerBackend(vllm_server.url, tokenizer=vllm_model_dir, lora_sync="adapters")
    try:
        with pytest.raises(GenerationServerError) as raised:
            backend.sync_weights(lora_policy(vllm_model_dir, r=4, seed=1))
        message = str(raised.value)
        assert raised.value.url == vllm_server.url
        assert f"{vllm_server.url} cannot serve this LoRA policy's adapters" in message
        assert "started without LoRA (no --enable-lora)" in message
        assert "training.vllm_server.lora_sync" in message
        assert "--enable-lora --max-lora-rank R" in message
        assert "lora_sync: merged" in message
        # a setting to fix, not a failing server: nothing retired, the version kept
        assert backend.urls == (vllm_server.url,)
        assert backend.retired == ()
        assert backend.version == 0
    finally:
        backend.close()


@pytest.mark.vllm_server
def test_an_adapter_rank_above_the_servers_is_refused(
    lora_backend: VLLMServerBackend, vllm_model_dir: Path
) -> None:
    rank = 2 * LORA_SERVER_RANK
    with pytest.raises(GenerationServerError) as raised:
        lora_backend.sync_weights(lora_policy(vllm_model_dir, r=rank, seed=1))
    assert raised.value.url == lora_backend.urls[0]
    assert f"its --max-lora-rank is {LORA_SERVER_RANK}, below the policy's lora.r of {rank}" in str(
        raised.value
    )
    assert lora_backend.version == 0


@pytest.mark.vllm_server
def test_an_adapters_sync_of_embedding_or_head_adapters_is_refused_before_sending(
    lora_backend: VLLMServerBackend, vllm_model_dir: Path, tmp_path: Path
) -> None:
    from lora_models import lora_on, untied_copy

    from agile_llmenvs.errors import LoRASyncError

    untied = untied_copy(vllm_model_dir, tmp_path / "untied")
    version = lora_backend.version
    for targets, module in [
        (["q_proj", "embed_tokens"], "model.embed_tokens"),
        (["lm_head"], "lm_head"),
    ]:
        with pytest.raises(LoRASyncError) as raised:
            lora_backend.sync_weights(lora_on(untied, targets))
        assert f"\n  - {module}: an adapters-only sync sends linear layers' adapters" in str(
            raised.value
        )
        assert "set training.vllm_server.lora_sync: merged" in str(raised.value)
        assert lora_backend.version == version  # nothing sent
        assert not lora_backend.weights_folder(version + 1).exists()
