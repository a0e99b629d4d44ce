"""TRL's GRPOTrainer on our envs through ``agile_llmenvs.integrations.trl``.

The trainer tests run real TRL on the tiny model and compare what TRL's loss receives with the
harness's own samples of the same episodes, exactly. The unit tests drive ``TRLEnv.rollout``
with a scripted policy, so row placement (restarts, failures, refills) is pinned by hand.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("trl")

import torch
from integrations.trl_fakes import scripted
from transformers import AutoTokenizer

from agile_llmenvs.core import TokenSample
from agile_llmenvs.envs import make_rollout_env_factory
from agile_llmenvs.errors import EnvBuildError, EnvError
from agile_llmenvs.integrations.trl import (
    RolloutReport,
    TRLEnv,
    TRLEnvConfig,
    policy_text_reward,
)
from agile_llmenvs.specs import LLMEnvSpec

pytestmark = pytest.mark.filterwarnings("ignore:You are using 'rollout_func'")

Row = tuple[tuple[int, ...], tuple[bool, ...]]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _spec(entrypoint: str, **fields: Any) -> LLMEnvSpec:
    return LLMEnvSpec.model_validate({"env_type": "rollout", "entrypoint": entrypoint, **fields})


# -- what TRL trains on ----------------------------------------------------------------------


def _trained_rows(inputs: dict[str, Any]) -> list[tuple[Row, float]]:
    """Each row TRL's loss receives, unpadded, as (ids, next-token mask) and its advantage."""
    rows = []
    for b in range(inputs["prompt_ids"].shape[0]):
        prompt = inputs["prompt_ids"][b][inputs["prompt_mask"][b].bool()].tolist()
        keep = inputs["completion_mask"][b].bool()
        completion = inputs["completion_ids"][b][keep].tolist()
        env_mask = inputs["tool_mask"][b][keep].tolist()
        mask = (False,) * (len(prompt) - 1) + tuple(bool(m) for m in env_mask)
        rows.append(((tuple(prompt + completion), mask), float(inputs["advantages"][b])))
    return rows


def _harness_rows(report: RolloutReport, num_generations: int) -> list[tuple[Row, float]]:
    """The harness's own samples that got rows, with the advantage TRL should give them:
    ``reward - mean`` over the scored rows of their group (``scale_rewards="none"``)."""
    rewards = [row.reward for row in report.rows]
    advantage = {}
    for start in range(0, len(rewards), num_generations):
        scored = [r for r in rewards[start : start + num_generations] if r is not None]
        for i in range(start, start + num_generations):
            value = rewards[i]
            advantage[i] = 0.0 if value is None else value - sum(scored) / len(scored)
    rows = []
    for played in report.episodes:
        for index, sample in zip(played.rows, played.episode.samples, strict=False):
            rows.append(((sample.token_ids, sample.action_mask), advantage[index]))
    return rows


def _key(rows: list[tuple[Row, float]]) -> Counter[tuple[Row, float]]:
    return Counter((row, round(advantage, 5)) for row, advantage in rows)


def _mask_runs(mask: tuple[bool, ...]) -> int:
    """Stretches of sampled ids in a mask: the turns of the sample."""
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))


def _train(
    env: TRLEnv,
    model_dir: Path,
    tmp_path: Path,
    reward_funcs: Sequence[Callable[..., Any]] = (),
    **settings: Any,
) -> tuple[Any, list[RolloutReport], list[dict[str, Any]]]:
    """Run GRPOTrainer through the adapter (``reward_funcs`` added through
    ``trainer_kwargs``); returns the trainer, each rollout's report and the inputs of every
    loss computation (CPU copies)."""
    from trl import GRPOConfig, GRPOTrainer

    reports: list[RolloutReport] = []

    def rollout_func(prompts: list[str], trainer: Any) -> dict[str, list[Any]]:
        columns = env.rollout_func(prompts, trainer)
        assert env.report is not None
        reports.append(env.report)
        return columns

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        **{
            "per_device_train_batch_size": 8,
            "num_generations": 4,
            "max_completion_length": 6,
            "learning_rate": 1e-3,
            "scale_rewards": "none",
            "use_cpu": True,
            "bf16": False,
            "report_to": [],
            "save_strategy": "no",
            "logging_steps": 1,
            "seed": 0,
            **settings,
        },
    )
    kwargs = {**env.trainer_kwargs(reward_funcs), "rollout_func": rollout_func}
    trainer = GRPOTrainer(model=str(model_dir), args=args, processing_class=env.tokenizer, **kwargs)
    seen: list[dict[str, Any]] = []
    compute_loss = trainer._compute_loss

    def recording(model: Any, inputs: dict[str, Any]) -> Any:
        seen.append({k: v.detach().cpu().clone() for k, v in inputs.items() if torch.is_tensor(v)})
        return compute_loss(model, inputs)

    trainer._compute_loss = recording
    trainer.train()
    return trainer, reports, seen


def _load(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)


@pytest.fixture
def seeded_turns_manifest(tmp_path: Path) -> Path:
    """A manifest of a multi-turn env: 1 + seed % 3 turns, rewarded by digit share."""
    path = tmp_path / "seeded_turns.yaml"
    path.write_text(
        "name: seeded-turns\nenv:\n  env_type: rollout\n  entrypoint: echo_envs:SeededTurnsEnv\n"
        "seed: 3\n"
    )
    return path


def test_grpo_trainer_trains_on_exactly_the_harness_samples(
    seeded_turns_manifest: Path, tiny_model_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    env = TRLEnv.from_manifest(seeded_turns_manifest, tokenizer, config=TRLEnvConfig(num_tasks=16))
    with env:
        before = {k: v.clone() for k, v in _load(tiny_model_dir).state_dict().items()}
        trainer, reports, seen = _train(env, tiny_model_dir, tmp_path, max_steps=3)
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k].cpu()) for k in before)
    assert len(reports) == len(seen) == 3  # one generation and one loss per step
    for report, inputs in zip(reports, seen, strict=True):
        assert _key(_trained_rows(inputs)) == _key(_harness_rows(report, 4))
        assert report.masked_rows == ()
        for played in report.episodes:  # one sample per episode, one mask stretch per turn
            [sample] = played.episode.samples
            assert _mask_runs(sample.action_mask) == played.episode.num_turns
    turns = Counter(p.episode.num_turns for r in reports for p in r.episodes)
    assert set(turns) >= {2, 3}, turns  # env ids inside multi-turn completions, mask 0
    assert env.stats.rows == env.stats.episodes == env.stats.samples == 24


def _mask_stretches(sample: TokenSample) -> list[tuple[int, ...]]:
    """The ids of each stretch of sampled ids in the sample (``action_mask[k]`` describes
    ``token_ids[k + 1]``): the policy's turns."""
    stretches: list[list[int]] = []
    for k, sampled in enumerate(sample.action_mask):
        if sampled and (k == 0 or not sample.action_mask[k - 1]):
            stretches.append([])
        if sampled:
            stretches[-1].append(sample.token_ids[k + 1])
    return [tuple(ids) for ids in stretches]


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """Ids as TRL decodes a completion."""
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def test_an_added_reward_function_sees_the_messages_and_the_policy_text_only(
    seeded_turns_manifest: Path, tiny_model_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    seen: list[dict[str, Any]] = []

    def turns_played(
        prompts: list[Any], completions: list[Any], completion_ids: list[Any], **columns: Any
    ) -> list[float]:
        seen.append({"prompts": prompts, "completions": completions, "ids": completion_ids})
        return [float(len(completion)) for completion in completions]

    env = TRLEnv.from_manifest(seeded_turns_manifest, tokenizer, config=TRLEnvConfig(num_tasks=16))
    with env:
        trainer, reports, _ = _train(env, tiny_model_dir, tmp_path, [turns_played], max_steps=2)
    assert trainer.reward_func_names == ["env_reward", "turns_played"]
    assert len(seen) == len(reports) == 2
    multi_turn_rows = 0
    for record, report in zip(seen, reports, strict=True):
        expected: dict[int, tuple[Any, list[dict[str, str]]]] = {}
        for played in report.episodes:
            prompt = env.prompts[env.tasks.index(played.task)]
            for row, sample in zip(played.rows, played.episode.samples, strict=False):
                texts = [_decode(tokenizer, ids) for ids in _mask_stretches(sample)]
                expected[row] = (prompt, [{"role": "assistant", "content": t} for t in texts])
        assert sorted(expected) == list(range(8))
        # the prompt TRL passes on is the task's conversation, as the dataset holds it
        assert record["prompts"] == [expected[row][0] for row in range(8)]
        # the completion is the policy's turns, one assistant message each, and nothing else
        assert record["completions"] == [expected[row][1] for row in range(8)]
        for completion, ids in zip(record["completions"], record["ids"], strict=True):
            if len(completion) > 1:  # TRL's own completion holds the env's "turn 1" between
                multi_turn_rows += 1
                assert "turn 1" in _decode(tokenizer, ids)
                assert all("turn 1" not in message["content"] for message in completion)
    assert multi_turn_rows > 0


def test_policy_text_rewards_keep_name_and_asyncness_and_refuse_reward_models() -> None:
    import inspect

    async def judge(completions: list[Any], **columns: Any) -> list[float]:
        return [float(len(c[0]["content"])) for c in completions]

    wrapped = policy_text_reward(judge)
    assert wrapped.__name__ == "judge"
    assert inspect.iscoroutinefunction(wrapped)
    policy = [[{"role": "assistant", "content": "abc"}]]
    trl_text = [[{"role": "assistant", "content": "abc\nuser\nturn 1"}]]
    rewards = asyncio.run(wrapped(completions=trl_text, policy_completion=policy, prompts=[[]]))
    assert rewards == [3.0]
    with pytest.raises(ValueError, match="no policy_completion column"):
        asyncio.run(wrapped(completions=trl_text))
    with pytest.raises(TypeError, match="a reward model scores the completions TRL decodes"):
        policy_text_reward("some/reward-model")  # type: ignore[arg-type]


def test_failed_env_is_reported_and_its_masked_rows_add_no_gradient(
    tiny_model_dir: Path, tokenizer: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = _spec("echo_envs:RowEnv", env_config={"rows": 4, "turns": 2})
    env = TRLEnv(spec, tokenizer)
    # the rollout env (built at the first rollout) fails on row 1 once the dataset is read
    env.spec = _spec("echo_envs:RowEnv", env_config={"rows": 4, "turns": 2, "fail_rows": [1]})
    with env, caplog.at_level(logging.WARNING, "agile_llmenvs.integrations.trl"):
        trainer, reports, seen = _train(env, tiny_model_dir, tmp_path, max_steps=2)
    # two steps of two groups cover the four rows once; row 1's four episodes fail on reset
    assert env.stats.failed_episodes == 4
    assert env.stats.masked_rows == 4
    [failing] = [i for i, r in enumerate(reports) if r.failed_episodes]
    report, inputs = reports[failing], seen[failing]
    failed = [p for p in report.episodes if p.failed]
    assert [p.task.row_index for p in failed] == [1, 1, 1, 1]
    assert all(p.rows == () for p in failed)
    assert "RuntimeError: row 1 cannot be loaded" in failed[0].episode.info["error"]
    assert "4 of 8 episodes failed" in caplog.text
    logged = [
        h["env/failed_episodes"] for h in trainer.state.log_history if "env/failed_episodes" in h
    ]
    assert sorted(logged) == [0.0, 4.0]  # TRL's logs, one entry per step
    # what TRL trains on: the other group's samples exactly, and four masked rows
    trained = _trained_rows(inputs)
    assert _key([r for r in trained if any(r[0][1])]) == _key(_harness_rows(report, 4))
    masked = [b for b, ((_, mask), _) in enumerate(trained) if not any(mask)]
    assert len(masked) == 4
    assert all(trained[b][1] == 0.0 for b in masked)  # unscorable: advantage 0
    # whatever their advantage, masked rows add no gradient (dapo normalises by tokens)
    inputs = {**inputs, "advantages": torch.linspace(-1.0, 1.0, len(trained))}
    kept = [b for b in range(len(trained)) if b not in masked]
    with_masked, loss = _gradient(trainer, inputs)
    without, loss_without = _gradient(trainer, {k: _rows(v, kept) for k, v in inputs.items()})
    assert loss.abs() > 0
    torch.testing.assert_close(loss_without, loss)
    torch.testing.assert_close(without, with_masked)


def _rows(value: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return value[rows] if value.dim() > 0 else value


def _gradient(trainer: Any, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    model = trainer.model
    model.zero_grad()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    return torch.cat([g.flatten() for g in grads]), loss.detach()


# -- the rollout, driven by hand -------------------------------------------------------------


@pytest.fixture
def restarting_env(tokenizer: Any) -> Iterator[TRLEnv]:
    """Two turns an episode; a 40-digit reply pushes the context past the 60-token segment
    budget, so every episode restarts once: two samples."""
    spec = _spec(
        "echo_envs:ScriptedEnv",
        env_config={"observations": ["first question", "second question", "done"]},
        segment_prompt_tokens=60,
        max_turns=2,
    )
    env = TRLEnv(spec, tokenizer, config=TRLEnvConfig(num_tasks=2))
    env.build(max_tokens_per_turn=64, max_model_len=None)
    yield env
    env.close()


def test_restarted_episode_gives_one_row_per_sample(restarting_env: TRLEnv, tokenizer: Any) -> None:
    env, prompt = restarting_env, restarting_env.prompts[0]
    columns = env.rollout([prompt] * 4, scripted(tokenizer, "7" * 40), num_generations=4)
    report = env.report
    assert report is not None
    # the first wave plays one episode per row: the first two fill the group, two by two
    assert [p.rows for p in report.episodes] == [(0, 1), (2, 3), (), ()]
    assert (report.discarded_episodes, report.dropped_samples) == (2, 4)
    for played in report.episodes[:2]:
        first, restarted = played.episode.samples
        assert played.episode.info["restart"]["dropped_actions"] == 1
        for index, sample in zip(played.rows, (first, restarted), strict=True):
            ids = columns["prompt_ids"][index] + columns["completion_ids"][index]
            assert tuple(ids) == sample.token_ids
            assert columns["env_mask"][index] == [1] * 41  # 40 digits and end-of-turn
    assert columns["env_reward"] == [3.0] * 4  # turn rewards 1 + 2, on both samples
    # the second rollout sizes its wave by the two samples an episode gives
    env.rollout([prompt] * 4, scripted(tokenizer, "7" * 40), num_generations=4)
    assert [p.rows for p in env.report.episodes] == [(0, 1), (2, 3)]
    assert env.stats.samples_per_episode == 2.0


def test_the_episode_that_overfills_a_group_keeps_its_first_samples(
    restarting_env: TRLEnv, tokenizer: Any
) -> None:
    prompt = restarting_env.prompts[0]
    restarting_env.rollout([prompt] * 3, scripted(tokenizer, "7" * 40), num_generations=3)
    report = restarting_env.report
    assert report is not None
    assert [p.rows for p in report.episodes] == [(0, 1), (2,), ()]
    assert (report.discarded_episodes, report.dropped_samples) == (1, 3)


def test_failed_episode_rows_are_refilled_by_the_next_wave(tokenizer: Any) -> None:
    # EchoEnv raises on "boom" and ends the episode on "stop" (reward 1.0, its turn)
    with TRLEnv(_spec("echo_envs:EchoEnv"), tokenizer) as env:
        env.build(max_tokens_per_turn=8, max_model_len=None)
        columns = env.rollout(
            [env.prompts[2]] * 4, scripted(tokenizer, "boom|stop", "stop"), num_generations=4
        )
    report = env.report
    assert report is not None
    assert [p.rows for p in report.episodes] == [(), (0,), (1,), (2,), (3,)]
    assert [p.failed for p in report.episodes] == [True, False, False, False, False]
    assert "ValueError: the env exploded" in report.episodes[0].episode.info["error"]
    assert {p.task for p in report.episodes} == {env.tasks[2]}
    assert columns["env_reward"] == [1.0] * 4
    assert report.masked_rows == ()


def test_policy_completion_is_the_sampled_text_and_empty_on_masked_rows(tokenizer: Any) -> None:
    spec = _spec("echo_envs:RowEnv", env_config={"rows": 2})
    with TRLEnv(spec, tokenizer) as env:
        env.spec = _spec("echo_envs:RowEnv", env_config={"rows": 2, "fail_rows": [1]})
        env.build(max_tokens_per_turn=8, max_model_len=None)
        prompts = [env.prompts[0]] * 2 + [env.prompts[1]] * 2
        columns = env.rollout(prompts, scripted(tokenizer, "0"), num_generations=2)
    assert columns["env_reward"] == [1.0, 1.0, None, None]
    # the sampled "0<|im_end|>" decoded as TRL decodes it; a masked row has one empty turn
    assert columns["policy_completion"] == [
        [{"role": "assistant", "content": "0"}],
        [{"role": "assistant", "content": "0"}],
        [{"role": "assistant", "content": ""}],
        [{"role": "assistant", "content": ""}],
    ]


def test_every_episode_failing_raises(tokenizer: Any) -> None:
    with TRLEnv(_spec("echo_envs:RowEnv", env_config={"rows": 2}), tokenizer) as env:
        env.spec = _spec("echo_envs:RowEnv", env_config={"rows": 2, "fail_rows": [0, 1]})
        env.build(max_tokens_per_turn=8, max_model_len=None)
        with pytest.raises(EnvError, match="every episode of this TRL batch failed: 4 of 4"):
            env.rollout([env.prompts[0]] * 4, scripted(tokenizer, "0"), num_generations=4)
    assert env.stats.failed_episodes == 4


def test_dataset_rows_are_the_env_tasks_and_their_first_prompts(tokenizer: Any) -> None:
    spec = _spec("echo_envs:RowEnv", env_config={"rows": 5})
    with TRLEnv(spec, tokenizer) as env:
        # TRL's conversational format: the first prompt as messages
        assert env.dataset["prompt"] == env.prompts
        assert env.prompts == [[{"role": "user", "content": f"Say {r}."}] for r in range(5)]
        assert [t.row_index for t in env.tasks] == [0, 1, 2, 3, 4]
        factory, _ = make_rollout_env_factory(spec, tokenizer, seed=0)
        harness = factory()
        for task, prompt in zip(env.tasks, env.dataset["prompt"], strict=True):
            rendered = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
            assert rendered["input_ids"] == harness.reset(**task.reset_kwargs())
        harness.close()
        env.build(max_tokens_per_turn=8, max_model_len=None)
        # process 1 of 2 holds global rows 6..11: the last two of group 1, all of group 2
        prompts = [env.prompts[3]] * 2 + [env.prompts[4]] * 4
        env.rollout(
            prompts, scripted(tokenizer, "3"), num_generations=4, process_index=1, world_size=2
        )
    report = env.report
    assert report is not None
    assert [(p.group, p.task.row_index, p.rows) for p in report.episodes] == [
        (1, 3, (0,)),
        (1, 3, (1,)),
        (2, 4, (2,)),
        (2, 4, (3,)),
        (2, 4, (4,)),
        (2, 4, (5,)),
    ]


def test_a_task_the_env_cannot_reset_to_fails_the_build(tokenizer: Any) -> None:
    spec = _spec("echo_envs:RowEnv", env_config={"rows": 3, "fail_rows": [2]})
    with pytest.raises(EnvBuildError, match=r"failed to reset to Task\(.*row_index=2\)"):
        TRLEnv(spec, tokenizer)


def test_a_group_of_rows_with_different_prompts_is_refused(tokenizer: Any) -> None:
    with TRLEnv(_spec("echo_envs:RowEnv", env_config={"rows": 2}), tokenizer) as env:
        env.build(max_tokens_per_turn=8, max_model_len=None)
        with pytest.raises(ValueError, match="different prompts; pass the trainer's"):
            env.rollout(env.prompts, scripted(tokenizer, "0"), num_generations=2)
        with pytest.raises(ValueError, match="is not one of this env's tasks"):
            env.rollout(["hello"] * 2, scripted(tokenizer, "0"), num_generations=2)


def test_sampling_settings_the_rollout_cannot_apply_are_refused(tokenizer: Any) -> None:
    from trl import GRPOConfig

    from agile_llmenvs.integrations._trl_play import check_sampling

    args = GRPOConfig(output_dir="unused", min_p=0.1, report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match=r"sets \['min_p'\]"):
        check_sampling(SimpleNamespace(args=args, use_vllm=False))
    with pytest.raises(ValueError, match="use_vllm=True"):
        check_sampling(SimpleNamespace(args=args, use_vllm=True))
