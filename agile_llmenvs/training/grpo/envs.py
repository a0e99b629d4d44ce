"""The rollout envs of a GRPO run: one maker of env factories for the training tasks and the
held-out ones, so both play the same env, with the same tokenizer, context and seed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from agile_llmenvs.specs import LLMEnvSpec

__all__ = ["RolloutEnvs"]


@dataclass(frozen=True)
class RolloutEnvs:
    """Makes factories of the run's rollout env
    (:func:`~agile_llmenvs.envs.make_rollout_env_factory`).

    Attributes:
        spec: The env.
        tokenizer: The policy's tokenizer.
        processor: A vision-language policy's processor, which the envs' images are shown to
            (``None`` for a text policy).
        max_model_len: The context an episode may fill.
        max_new_tokens: Tokens generated per turn (prompts leave room for them).
        seed: The run's seed (a dataset env's train/test split).
    """

    spec: LLMEnvSpec
    tokenizer: Any
    processor: Any
    max_model_len: int
    max_new_tokens: int
    seed: int

    def factory(self, split: Literal["train", "test"] = "train") -> tuple[Callable[[], Any], int]:
        """A factory of fresh envs playing ``split``'s tasks, and the env's turn budget."""
        from agile_llmenvs.envs import make_rollout_env_factory

        return make_rollout_env_factory(
            self.spec,
            self.tokenizer,
            max_model_len=self.max_model_len,
            max_output_tokens=self.max_new_tokens,
            seed=self.seed,
            split=split,
            vision_processor=self.processor,
        )

    @property
    def held_out_split(self) -> Literal["train", "test"]:
        """Where held-out tasks come from: a dataset env's test split; any other env has one
        stream of tasks, drawn from a seed of their own."""
        return "test" if self.spec.source == "dataset" else "train"
