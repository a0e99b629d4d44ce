"""TRL's GRPOTrainer on an OpenEnv env with a typed action (#34): the tiny random policy's text
is no ``int``, so every turn is invalid, scored ``invalid_action_reward``, and no episode
fails (before, every episode failed and training stopped at step 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

from transformers import AutoTokenizer

from agile_llmenvs.integrations.trl import RolloutReport, TRLEnv, TRLEnvConfig
from agile_llmenvs.llm_envs import StopReason
from agile_llmenvs.specs import LLMEnvSpec

pytestmark = pytest.mark.filterwarnings("ignore:You are using 'rollout_func'")


def test_one_trl_step_on_the_typed_env_fails_no_episode(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    spec = LLMEnvSpec.model_validate(
        {
            "env_type": "rollout",
            "entrypoint": "typed_envs:IntGuessEnvironment",
            "action_field": "guess",
            "invalid_action_reward": -0.5,
        }
    )
    reports: list[RolloutReport] = []
    with TRLEnv(spec, tokenizer, config=TRLEnvConfig(num_tasks=4, seed=0)) as env:

        def rollout_func(prompts: list[str], trainer: Any) -> dict[str, list[Any]]:
            columns = env.rollout_func(prompts, trainer)
            assert env.report is not None
            reports.append(env.report)
            return columns

        args = GRPOConfig(
            output_dir=str(tmp_path / "trl"),
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=4,
            max_steps=1,
            use_cpu=True,
            bf16=False,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            seed=0,
        )
        kwargs = {**env.trainer_kwargs(), "rollout_func": rollout_func}
        trainer = GRPOTrainer(
            model=str(tiny_model_dir), args=args, processing_class=tokenizer, **kwargs
        )
        trainer.train()
    assert env.stats.failed_episodes == 0
    [report] = reports
    assert report.failed_episodes == 0
    for played in report.episodes:
        assert played.episode.stop_reason is StopReason.MAX_TURNS
        assert played.episode.rewards == (-0.5, -0.5, -0.5)
        assert "guess: Input should be a valid integer" in played.episode.info["invalid_action"]
    assert trainer.state.global_step == 1
