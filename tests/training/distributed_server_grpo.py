"""Run under ``accelerate launch``: GRPO from a running ``vllm serve``, several processes.

Usage: ``distributed_server_grpo.py MANIFEST OUTPUT_DIR [random-adapters]``; with
``random-adapters`` a LoRA policy starts with seeded random ``B`` (peft's zero start would
serve the base model). After every weight sync each rank
asks the server for greedy ids of a few prompts, and rank 0 compares them with the greedy ids
of the trainer's policy made whole (an FSDP-sharded policy's shards gathered into an
unsharded copy). Rank ``r`` writes ``OUTPUT_DIR/rank{r}.json``: the syncs (version, the
server's ids, rank 0's trainer ids), the version each trained episode was sampled from, per
step, and the steps' rewards (rank 0: the reduced metric rows).
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
from agile_llmenvs.training.generation import Round, ServerRollouts
from agile_llmenvs.training.policy import apply_lora
from agile_llmenvs.training.policy import loading as policy_loading

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
DIGITS = ("Say the digit 3.", "Say the digit 7.", "What is 2 + 2? Answer with a digit.")

syncs: list[dict[str, Any]] = []
rounds: list[tuple[int, list[int | None]]] = []
state: dict[str, Any] = {}


real_sync = ServerRollouts.sync


def _checked_sync(self: ServerRollouts, policy: Any, version: int) -> float:
    seconds = real_sync(self, policy, version)
    tokenizer = self.backend.tokenizer
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        for text in DIGITS
    ]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    served = [list(g.token_ids) for g in self.backend.generate(ids, GREEDY)]
    was_training = policy.training
    whole = whole_copy(policy, state["model_dir"])
    trainer = None
    if whole is not None:
        whole.eval()
        with torch.no_grad():
            greedy = HFBackend.from_model(whole, tokenizer).generate(ids, GREEDY)
        trainer = [list(g.token_ids) for g in greedy]
    policy.train(was_training)
    syncs.append({"version": version, "served": served, "trainer": trainer})
    return seconds


real_next = ServerRollouts.next_round


def _recording_next(self: ServerRollouts, step: int) -> tuple[Round, float]:
    played, waited = real_next(self, step)
    rounds.append((step, [t.policy_version for t in played.batch.trajectories]))
    return played, waited


def _random_adapters(model: Any, spec: Any) -> Any:
    policy = apply_lora(model, spec)
    generator = torch.Generator().manual_seed(0)  # the same on every process
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return policy


if __name__ == "__main__":
    manifest_path, output_dir = Path(sys.argv[1]), Path(sys.argv[2])
    manifest = load_manifest(manifest_path)
    state["model_dir"] = manifest.model.path
    if sys.argv[3:] == ["random-adapters"]:
        policy_loading.apply_lora = _random_adapters  # type: ignore[attr-defined]
    ServerRollouts.sync = _checked_sync  # type: ignore[method-assign]
    ServerRollouts.next_round = _recording_next  # type: ignore[method-assign]
    result = train_grpo(manifest)
    rank = torch.distributed.get_rank()
    record = {
        "world_size": torch.distributed.get_world_size(),
        "syncs": syncs,
        "rounds": rounds,
        "rewards": [row["reward_mean"] for row in result.metrics],
        "stale_groups": [row["stale_groups"] for row in result.metrics],
    }
    (output_dir / f"rank{rank}.json").write_text(json.dumps(record))
