"""Evaluation during training: the current policy, greedy, on the same held-out tasks each time.

The held-out tasks are a dataset env's test split (``train_test_split``, or the source's own),
or, for an env of another source, tasks drawn from a seed stream of their own. Evaluation has
its own envs, collector and task assigner, and runs inside a fork of the RNG states, so it
never changes the training task sequence or its sampling, and no eval episode's reward reaches
a training batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from agile_llmenvs.backends.hf import HFBackend
from agile_llmenvs.backends.types import SamplingParams
from agile_llmenvs.llm_envs.collector import RolloutCollector
from agile_llmenvs.training.generation import Sampler
from agile_llmenvs.training.grpo.envs import RolloutEnvs
from agile_llmenvs.training.policy import GenerationSync, is_sharded
from agile_llmenvs.training.run import HeldOutSettings

__all__ = ["EVAL_METRICS", "EVAL_SEED_OFFSET", "HeldOutEval"]

#: The metrics an evaluation adds to its step's row (empty on the other rows).
EVAL_METRICS = ("eval_reward_mean", "eval_success_rate")

#: Added to the run's seed: the seed of the held-out task stream, apart from the training one.
EVAL_SEED_OFFSET = 7_919


@dataclass
class HeldOutEval:
    """Greedy episodes on fixed held-out tasks, every ``every`` steps.

    Attributes:
        collector: The eval envs, ``tasks`` groups of one.
        start_state: The collector's task position before the first eval (restored each time).
        params: Greedy sampling, the training run's token budget.
        every: Steps between evaluations.
        success_reward: An episode succeeds when its reward reaches it.
    """

    collector: RolloutCollector
    start_state: dict[str, Any]
    params: SamplingParams
    every: int
    success_reward: float

    @classmethod
    def build(
        cls, settings: HeldOutSettings, envs: RolloutEnvs, accelerator: Any
    ) -> HeldOutEval | None:
        """The run's evaluation, or ``None`` when ``settings.every`` is 0 (``envs``: the run's,
        whose held-out split the eval envs play)."""
        if not settings.every:
            return None
        factory, _ = envs.factory(envs.held_out_split)
        world = accelerator.num_processes
        tasks = -(-settings.tasks // world) * world  # a multiple of the processes
        collector = RolloutCollector(
            factory,
            tasks,
            1,
            base_seed=envs.seed + EVAL_SEED_OFFSET,
            rank=accelerator.process_index,
            world_size=world,
        )
        state = collector.state_dict()
        return cls(collector, state, settings.params, settings.every, settings.success_reward)

    def due(self, step: int) -> bool:
        """Whether step ``step`` (1-based, done) is followed by an evaluation."""
        return step % self.every == 0

    def run(self, policy: Any, tokenizer: Any, accelerator: Any) -> dict[str, float]:
        """Play every held-out task once with ``policy``; the means over every process."""
        sync = GenerationSync(accelerator.device) if is_sharded(policy) else None
        sampler = Sampler(HFBackend.from_model(policy, tokenizer), self.params, sync=sync)
        python_state = random.getstate()
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                policy.eval()
                self.collector.load_state_dict(self.start_state)  # the same tasks each time
                batch = self.collector.collect(sampler)
                sampler.drain()
        finally:
            random.setstate(python_state)
        rewards = [t.reward for t in batch.trajectories if not t.failed]
        successes = sum(reward >= self.success_reward for reward in rewards)
        totals = torch.tensor(
            [sum(rewards), float(successes), float(len(rewards))], device=accelerator.device
        )
        if accelerator.num_processes > 1:
            totals = accelerator.reduce(totals, reduction="sum")
        total, won, episodes = totals.tolist()
        episodes = max(episodes, 1.0)
        return {"eval_reward_mean": total / episodes, "eval_success_rate": won / episodes}

    def close(self) -> None:
        """Release the eval envs."""
        self.collector.close()
