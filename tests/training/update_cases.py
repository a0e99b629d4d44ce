"""One GRPO update on a fixed synthetic batch, for the equivalence tests (in-process and
under ``accelerate launch``): the tiny model, plain SGD, no clip on the gradient norm.

SGD makes the parameter update ``-lr * gradient`` exactly, so a wrong normalisation shows
(Adam's first step, ``lr * sign(g)`` nearly, would hide a wrong scale).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from agile_llmenvs.training.grpo import PolicyBatch, UpdateSettings, grpo_update
from agile_llmenvs.training.objective import scored_token_logps
from agile_llmenvs.training.policy import Learner

ROWS = 7
LR = 0.1


def synthetic_batch(model: Any, *, seed: int = 0) -> PolicyBatch:
    """Seven rows of different lengths: a prompt, then sampled tokens with an env-inserted
    stretch in the middle (two turns); sampler log-probs off the policy's by noise, so the
    ratios spread and the clip engages; advantages of both signs."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [9, 14, 6, 12, 16, 11, 8]
    width = max(lengths)
    ids = torch.randint(4, 300, (ROWS, width), generator=generator)
    attention = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    ids = ids * attention
    action = torch.zeros(ROWS, width - 1, dtype=torch.bool)
    for row, length in enumerate(lengths):
        action[row, 2 : length - 1] = True  # position t scores token t + 1
        action[row, 4:6] = False  # the env's tokens between two turns
    action &= attention[:, 1:].bool()
    with torch.no_grad():
        own = scored_token_logps(model, ids, attention, action).logps_BT
    noise = 0.3 * torch.randn(ROWS, width - 1, generator=generator)
    sampling = torch.where(action, own + noise, torch.zeros_like(own))
    advantages = torch.randn(ROWS, generator=generator)
    return PolicyBatch(ids, attention, action, sampling, advantages)


def make_learner(model: Any, accelerator: Any) -> Learner:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return Learner(accelerator, model, optimizer, scheduler, max_grad_norm=1e9)


def load_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def update_delta(
    model_dir: Path,
    settings: UpdateSettings,
    *,
    accelerator: Any,
    rows: slice = slice(None),
    reference: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The flat parameter change of one ``grpo_update`` on ``rows`` of the synthetic batch."""
    model = load_model(model_dir)
    batch = synthetic_batch(model)
    ref = load_model(model_dir).eval() if reference else None
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    learner = make_learner(model, accelerator)
    local = batch.select(rows)
    metrics = grpo_update(learner, local, settings, ref)
    policy = accelerator.unwrap_model(learner.model)
    after = torch.cat([p.detach().flatten() for p in policy.parameters()])
    return after - before, metrics
