"""Run with 2 processes (gloo on CPU): two SGD updates of one of the cases that need a frozen
reference or adapters, on a policy either data parallel (``ddp``: DDP over whole copies) or
sharded by :func:`~agile_llmenvs.training.policy.sharding.shard_policy` (``fsdp``).

Cases:

- ``grpo_kl``: GRPO with a KL term (``beta`` 0.05) against the frozen reference of
  :func:`~agile_llmenvs.training.policy.reference_model` (under ``fsdp``, a copy sharded like
  the policy); rank 0 holds rows 0-4 of the synthetic batch and rank 1 rows 5-6, micro-batches
  of 3 rows, so one rank scores and learns from two micro-batches and the other from one.
- ``grpo_kl_idle``: the same with every row on rank 0: rank 1 has nothing to score or
  learn from (its episodes all failed, say), so its first pass of each model is an idle one
  (the models' post-head probes must pair up with rank 0's all the same).
- ``lora_grpo``: the same update of LoRA adapters, whose reference is the base model with the
  adapters off.
- ``dpo``: DPO on four preference pairs, rank 0 three and rank 1 one, micro-batches of 2
  pairs, against the frozen reference.

The first update starts at the reference (GRPO's KL is 0); the second measures the moved
policy against it.

Usage: ``sharded_updates.py CASE MODE MODEL_DIR OUTPUT_FILE``; rank 0 saves the change of
every parameter, each update's metrics and, under ``fsdp``, what the reference is (sharded,
frozen, unmoved) to ``OUTPUT_FILE``.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))

from update_cases import LR, load_model, synthetic_batch

from agile_llmenvs.llm_envs.dataset_env import PreferenceBatch
from agile_llmenvs.specs import LoRASpec
from agile_llmenvs.training.grpo import UpdateSettings, grpo_update
from agile_llmenvs.training.policy import (
    Learner,
    apply_lora,
    ddp_settings,
    reference_model,
    shard_policy,
)
from agile_llmenvs.training.supervised import DPOObjective, dataset_update

GRPO = UpdateSettings(loss_type="dapo", max_completion_tokens=20, beta=0.05, micro_batch_size=3)
LORA = LoRASpec(r=4, alpha=8, dropout=0.0)
UPDATES = 2


def preference_batch(seed: int = 0) -> PreferenceBatch:
    """Four pairs of different prompt and response lengths, right-padded to one width."""
    generator = torch.Generator().manual_seed(seed)
    prompts, chosen, rejected = [3, 5, 2, 4], [4, 2, 6, 3], [2, 5, 3, 6]
    width = max(p + max(c, r) for p, c, r in zip(prompts, chosen, rejected, strict=True))

    def side(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        for row, (prompt, response) in enumerate(zip(prompts, lengths, strict=True)):
            ids[row, : prompt + response] = torch.randint(4, 300, (prompt + response,))
            labels[row, prompt : prompt + response] = ids[row, prompt : prompt + response]
        return (
            ids,
            (labels != -100) | (torch.arange(width) < torch.tensor(prompts)[:, None]),
            labels,
        )

    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
    prompt_ids = torch.randint(4, 300, (len(prompts), width))
    chosen_ids, chosen_mask, chosen_labels = side(chosen)
    rejected_ids, rejected_mask, rejected_labels = side(rejected)
    for row, prompt in enumerate(prompts):  # a pair shares its prompt
        chosen_ids[row, :prompt] = rejected_ids[row, :prompt] = prompt_ids[row, :prompt]
    return PreferenceBatch(
        chosen_input_ids=chosen_ids,
        chosen_attention_mask=chosen_mask.long(),
        rejected_input_ids=rejected_ids,
        rejected_attention_mask=rejected_mask.long(),
        prompt_lengths=torch.tensor(prompts),
        chosen_labels=chosen_labels,
        rejected_labels=rejected_labels,
    )


def rows_of(batch: PreferenceBatch, rows: slice) -> PreferenceBatch:
    fields = {f.name: getattr(batch, f.name)[rows] for f in dataclasses.fields(batch)}
    return PreferenceBatch(**fields)


def flat(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter whole and flattened (every process must call it)."""
    whole = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return torch.cat([p.detach().flatten().clone() for p in whole])


def describe_reference(reference: Any, policy: torch.nn.Module) -> dict[str, Any]:
    """Whether the reference holds shards only, of the policy's shapes, frozen, in eval."""
    pairs = list(zip(reference.parameters(), policy.parameters(), strict=True))
    return {
        "sharded": all(isinstance(r, DTensor) for r, _ in pairs),
        "local_shapes_match": all(
            r.to_local().shape == p.to_local().shape and r.shape == p.shape for r, p in pairs
        ),
        "frozen": not any(r.requires_grad for r, _ in pairs),
        "eval": not reference.training,
    }


if __name__ == "__main__":
    case, mode, model_dir, output = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    accelerator = Accelerator(cpu=True, kwargs_handlers=[ddp_settings()])  # as training's
    rank = accelerator.process_index
    model = load_model(model_dir)
    grpo_batch = synthetic_batch(model)  # before any change: every rank builds the same one
    if case == "lora_grpo":
        torch.manual_seed(1)  # the same adapters on every rank, in both modes
        model = apply_lora(model, LORA)
    optimizer: Any
    if mode == "fsdp":
        model = shard_policy(model, accelerator.device)
        reference = reference_model(model, accelerator.device)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    else:
        reference = reference_model(model, accelerator.device)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        model, optimizer = accelerator.prepare(model, optimizer)
    plain = accelerator.unwrap_model(model)
    before = flat(plain)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    learner = Learner(accelerator, model, optimizer, scheduler, max_grad_norm=1e9)
    metrics = []
    for _ in range(UPDATES):
        if case == "dpo":
            pairs = rows_of(preference_batch(), slice(0, 3) if rank == 0 else slice(3, 4))
            objective = DPOObjective(reference, beta=0.1, chunk_tokens=4096)
            metrics.append(dataset_update(learner, pairs, objective, 2))
        else:
            split = 7 if case == "grpo_kl_idle" else 5
            rows = slice(0, split) if rank == 0 else slice(split, 7)
            metrics.append(grpo_update(learner, grpo_batch.select(rows), GRPO, reference))
    delta = flat(plain) - before
    described = None
    if mode == "fsdp" and case != "lora_grpo":
        described = {
            **describe_reference(reference, plain),
            "unmoved": bool(torch.equal(flat(reference), before)),
        }
    if accelerator.is_main_process:
        torch.save({"delta": delta, "metrics": metrics, "reference": described}, output)
