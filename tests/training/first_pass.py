"""Sample a batch with a real backend, then score it as GRPO's first pass does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from fakes import digit_messages
from training.update_cases import load_model, make_learner

from agile_llmenvs.backends import HFBackend, SamplingParams, TokenBackend, TokenDistribution
from agile_llmenvs.training.grpo import PolicyBatch, UpdateSettings, grpo_update
from agile_llmenvs.training.objective import scored_token_logps

__all__ = ["SHAPED", "first_pass", "rollout_batch"]


def rollout_batch(
    model_dir: Path, params: SamplingParams, backend: TokenBackend | None = None
) -> tuple[Any, PolicyBatch]:
    """Six digit prompts sampled by ``backend`` (HFBackend on the model by default), laid
    out right-padded, and the model to train."""
    from transformers import AutoTokenizer

    model = load_model(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        list(tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=False))
        for m in digit_messages(0, 1, 2, 3, 4, 5)
    ]
    backend = backend or HFBackend.from_model(model, tokenizer)
    generations = backend.generate(prompts, params)
    rows = [(p, g.token_ids, g.logprobs) for p, g in zip(prompts, generations, strict=True)]
    width = max(len(p) + len(ids) for p, ids, _ in rows)
    ids_BT = torch.zeros(len(rows), width, dtype=torch.long)
    action_BT = torch.zeros(len(rows), width - 1, dtype=torch.bool)
    sampling_BT = torch.zeros(len(rows), width - 1)
    for b, (prompt, completion, logps) in enumerate(rows):
        ids_BT[b, : len(prompt) + len(completion)] = torch.tensor([*prompt, *completion])
        action_BT[b, len(prompt) - 1 : len(prompt) - 1 + len(completion)] = True
        sampling_BT[b, len(prompt) - 1 : len(prompt) - 1 + len(completion)] = torch.tensor(logps)
    attention_BT = (ids_BT != 0).long()
    attention_BT[:, 0] = 1
    for b, (prompt, completion, _) in enumerate(rows):
        attention_BT[b] = (torch.arange(width) < len(prompt) + len(completion)).long()
    advantages = torch.linspace(-1.0, 1.0, len(rows))
    return model, PolicyBatch(ids_BT, attention_BT, action_BT, sampling_BT, advantages)


def first_pass(
    model_dir: Path, params: SamplingParams, backend: TokenBackend | None = None
) -> tuple[PolicyBatch, dict[str, float], torch.Tensor]:
    """Sample a batch, and score it: the recorded log-probs, the first pass's metrics, and
    the trainer's own log-probs of the sampled tokens."""
    model, batch = rollout_batch(model_dir, params, backend)
    assert batch.action_mask_BT.sum() > 20
    distribution = TokenDistribution.of(params)
    with torch.no_grad():
        trainer = scored_token_logps(
            model,
            batch.input_ids_BT,
            batch.attention_mask_BT,
            batch.action_mask_BT,
            distribution=distribution,
        ).logps_BT
    learner = make_learner(model, Accelerator(cpu=True))
    metrics = grpo_update(learner, batch, UpdateSettings(distribution=distribution))
    print(f"{params}: first-pass ratio mean {metrics['ratio_mean']:.7f}")
    return batch, metrics, trainer


#: The sampling settings every backend must record as the trainer scores them.
SHAPED = {
    "temperature": SamplingParams(max_tokens=8, temperature=0.5, seed=3),
    "top-p-k": SamplingParams(max_tokens=8, temperature=0.7, top_p=0.8, top_k=20, seed=5),
    "top-p-k40": SamplingParams(max_tokens=8, temperature=0.7, top_p=0.8, top_k=40, seed=9),
    "penalty": SamplingParams(
        max_tokens=8, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.1, seed=6
    ),
    "min-p": SamplingParams(max_tokens=8, temperature=1.0, min_p=0.5, seed=7),
    "untruncated": SamplingParams(
        max_tokens=8, temperature=0.7, top_p=0.8, top_k=20, truncated_logprobs=False, seed=8
    ),
}
