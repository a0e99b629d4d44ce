"""After a weight sync, does the sampler hold the policy? Its log-probs of a probe sequence
against the policy's own.

A sync that sends a weight wrong, or that the sampler loads wrong, leaves every later rollout
sampled from another policy than the one trained, with no error anywhere: the first-pass
ratio would be the only symptom. So after a sync the sampler (each process's vLLM engine, or
every server) scores a probe, the last :data:`PROBE_TOKENS` tokens of a row just trained on
(at setup, a fixed sentence), with its raw logits, and so does the policy, in eval mode; the
run stops with :class:`~agile_llmenvs.errors.SyncCheckError` when their mean absolute
difference exceeds the tolerance.

``training.sync_check: auto`` (the default) spends at most :data:`BUDGET` of the run's time
on it: the setup sync is always checked (once, not counted), and a later one when the checks
after it cost less than 1% of the steps so far (on a GPU, whose steps take seconds, that is
every sync).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from agile_llmenvs.errors import SyncCheckError
from agile_llmenvs.training.policy import any_process

__all__ = [
    "BUDGET",
    "PROBE_TOKENS",
    "SETUP_PROBE",
    "SyncCheck",
    "default_tolerance",
    "policy_logps",
    "probe_ids",
]

#: The share of a run's time ``training.sync_check: auto`` may spend on checks.
BUDGET = 0.01
#: The longest probe, in tokens.
PROBE_TOKENS = 64
#: The probe of the setup sync, before any row has been trained on.
SETUP_PROBE = "The sampler holds the policy being trained: 0 1 2 3 4 5 6 7 8 9."

SyncCheckMode = Literal["auto", "every", "off"]


def default_tolerance(dtype: torch.dtype) -> float:
    """The largest mean absolute log-prob difference a sync passes with: ``1e-3`` for a
    float32 (or float64) policy, whose kernels differ only in rounding; ``5e-2`` for 16-bit
    weights, where vLLM's kernels and transformers' round differently by about 1e-2."""
    return 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2


def probe_ids(input_ids_T: torch.Tensor, attention_T: torch.Tensor) -> list[int]:
    """The last :data:`PROBE_TOKENS` tokens of a trained row (its sampled tokens come last:
    the rows an embedding's adapter learned)."""
    ids = input_ids_T[attention_T.bool()].tolist()
    return [int(i) for i in ids[-PROBE_TOKENS:]]


def policy_logps(model: Any, ids: Sequence[int]) -> torch.Tensor:
    """``model``'s log-prob of each token of ``ids`` after the first, in eval mode, without
    gradients, as float32 on the CPU (a sharded model: every process calls it together)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            input_ids = torch.tensor([list(ids)], device=device)
            logits = model(input_ids=input_ids).logits[0, :-1].float()
    finally:
        model.train(was_training)
    targets = input_ids[0, 1:]
    return logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1).cpu()


@dataclass
class SyncCheck:
    """When to check a sync, and the check itself.

    Args:
        mode: ``auto`` (within :data:`BUDGET` of the run's time), ``every`` sync, or
            ``off``.
        tolerance: The largest mean absolute log-prob difference that passes.
        distributed: Several training processes decide together (rank 0's timing decides
            when; any process's failure stops them all).
    """

    mode: SyncCheckMode
    tolerance: float
    distributed: bool = False
    spent_s: float = 0.0
    run_s: float = 0.0
    gaps: list[float] = field(default_factory=list)

    def due(self, step_s: float, device: torch.device, *, main: bool = True) -> bool:
        """Count a step of ``step_s`` seconds, and say whether its sync is checked (the
        same answer on every process: the main one's)."""
        self.run_s += step_s
        if self.mode != "auto":
            return self.mode == "every"
        due = main and self.spent_s <= BUDGET * self.run_s
        if self.distributed:
            due = any_process(due, device)
        return due

    def __call__(
        self,
        policy: Any,
        ids: Sequence[int],
        sampler_logps: Callable[[Sequence[int]], Mapping[str, Sequence[float]]],
        *,
        when: str,
        budgeted: bool = True,
    ) -> float:
        """Compare the samplers' log-probs of ``ids`` with ``policy``'s (call it on every
        process when ``distributed``; a process without a sampler of its own gives none).

        Args:
            policy: The unwrapped policy.
            ids: The probe (at least two tokens).
            sampler_logps: This process's samplers' log-probs of ``ids``, by name.
            when: The sync, for the message (``"the weight sync after step 7"``).
            budgeted: Count its seconds against ``auto``'s budget (the setup sync's check,
                made once, is not).

        Returns:
            The largest mean absolute difference of this process's samplers (0 without).

        Raises:
            SyncCheckError: Some sampler, on any process, differs by more than the tolerance.
        """
        start = time.perf_counter()
        own = policy_logps(policy, ids)
        gaps = {
            name: float((torch.tensor(list(logps), dtype=torch.float32) - own).abs().mean())
            for name, logps in sampler_logps(ids).items()
        }
        name, gap = max(gaps.items(), key=lambda item: item[1], default=("", 0.0))
        bad = gap > self.tolerance
        if self.distributed:
            bad = any_process(bad, next(policy.parameters()).device)
        if budgeted:
            self.spent_s += time.perf_counter() - start
        self.gaps.append(gap)
        if bad:
            raise SyncCheckError(self._message(name, gap, len(ids), when))
        return gap

    def _message(self, name: str, gap: float, tokens: int, when: str) -> str:
        where = (
            f"{name}'s log-probs of a {tokens}-token probe differ from the policy's by "
            f"{gap:.3g} on average"
            if name
            else "on another process, a sampler's log-probs of the probe differ from the policy's"
        )
        return (
            f"after {when}, {where} (training.sync_check_tolerance {self.tolerance:g}): the "
            "sampler does not hold the policy being trained, and every rollout it samples "
            "would come from another policy. Stopped before learning from them. A weight the "
            "sync does not send, or the sampler does not load, is the usual cause: check that "
            "the sampler's vLLM serves this model's architecture and that "
            "training.lora.target_modules are merged (docs/training.md, 'Weight syncs'). If "
            "the difference is the sampler's numerics (16-bit kernels), raise "
            "training.sync_check_tolerance; training.sync_check: off turns the check off"
        )
