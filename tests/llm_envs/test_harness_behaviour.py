"""RolloutHarness: every stop reason, limits, segments, tool calls, templates and transports."""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import pytest
from echo_envs import EchoEnv, NonFiniteRewardEnv, ScriptedEnv, ToolEnv
from openenv_native import EchoAction, EchoEnvironment, EchoObservation

from agile_llmenvs.errors import EnvStateError
from agile_llmenvs.llm_envs import (
    ChatTemplateError,
    OpenEnvServer,
    RolloutHarness,
    StopReason,
    apply_chat_template,
)
from agile_llmenvs.llm_envs.harness import MALFORMED_FEEDBACK
from agile_llmenvs.specs import LLMEnvSpec

EOS = 2


def ids(tokenizer: Any, text: str, eos: bool = True) -> list[int]:
    return [*tokenizer.encode(text, add_special_tokens=False), *([EOS] if eos else [])]


def play(harness: RolloutHarness, tokenizer: Any, actions: list[str]) -> Any:
    harness.reset()
    for action in actions:
        if harness.step(ids(tokenizer, action)).done:
            break
    return harness.get_episode_data()


def test_terminated_truncated_and_max_turns(tokenizer: Any) -> None:
    terminated = play(RolloutHarness.local(ScriptedEnv(["a", "b"]), tokenizer, 5), tokenizer, ["x"])
    assert terminated.stop_reason is StopReason.TERMINATED
    truncated = play(
        RolloutHarness.local(ScriptedEnv(["a", "b", "c"], truncate=True), tokenizer, 5),
        tokenizer,
        ["x", "y"],
    )
    assert truncated.stop_reason is StopReason.TRUNCATED
    assert truncated.rewards == (1.0, 2.0)
    capped = RolloutHarness.local(ScriptedEnv(["a", "b", "c", "d"]), tokenizer, 2)
    data = play(capped, tokenizer, ["x", "y", "z"])
    assert data.stop_reason is StopReason.MAX_TURNS
    assert data.num_turns == 2
    assert data.token_ids[-1] == EOS  # the row ends at the last generation: no frame after it
    with pytest.raises(EnvStateError, match=r"the episode is over \(max_turns\); call reset"):
        capped.step([5])


def test_a_first_prompt_over_budget_ends_the_episode_at_turn_zero(tokenizer: Any) -> None:
    harness = RolloutHarness.local(
        ScriptedEnv(["a long first observation " * 5, "b"]), tokenizer, 3, max_model_len=10
    )
    prompt = harness.reset()
    assert harness.done
    data = harness.get_episode_data()
    assert data.stop_reason is StopReason.PROMPT_LIMIT
    assert data.info["prompt_limit"] == {"prompt_tokens": len(prompt), "max_model_len": 10}
    assert data.rewards == ()
    assert not any(data.action_mask)


def test_a_later_overflow_ends_the_row_at_the_last_generation(tokenizer: Any) -> None:
    observations = ["start", "a much longer second observation that will not fit " * 3, "c"]
    harness = RolloutHarness.local(ScriptedEnv(observations), tokenizer, 5, max_model_len=40)
    prompt = harness.reset()
    result = harness.step(ids(tokenizer, "go"))
    assert result.done
    data = harness.get_episode_data()
    assert data.stop_reason is StopReason.CONTEXT_LIMIT
    assert list(data.token_ids) == prompt + ids(tokenizer, "go")
    assert data.info["context_limit"]["max_model_len"] == 40
    assert data.rewards == (1.0,)


def test_env_failures_end_the_episode_as_a_value(tokenizer: Any) -> None:
    harness = RolloutHarness.local(EchoEnv(), tokenizer, 5)
    harness.reset()
    result = harness.step(ids(tokenizer, "boom", eos=False))
    assert (result.done, result.reward) == (True, 0.0)
    data = harness.get_episode_data()
    assert data.stop_reason is StopReason.ENV_ERROR
    assert "EnvExecutionError" in data.info["error"]
    assert "the env exploded" in data.info["error"]


def test_a_non_finite_reward_fails_its_episode_naming_the_env_step_and_value(
    tokenizer: Any,
) -> None:
    harness = RolloutHarness.local(NonFiniteRewardEnv(), tokenizer, 1)
    outcomes = []
    for _ in range(3):  # the env's episodes score NaN, infinity, then 1.0
        harness.reset()
        result = harness.step(ids(tokenizer, "7"))
        data = harness.get_episode_data()
        outcomes.append((result.reward, data.stop_reason, data.info.get("error")))
    refused = (
        "EnvExecutionError: in-process env 'NonFiniteRewardEnv', step 1: the env's reward is "
        "{0}: replies are JSON, which has no {0}; return a finite number [code EXECUTION_ERROR]"
    )
    assert outcomes == [
        (0.0, StopReason.ENV_ERROR, refused.format("NaN")),
        (0.0, StopReason.ENV_ERROR, refused.format("Infinity")),
        (1.0, StopReason.TERMINATED, None),
    ]


def test_a_non_finite_number_in_an_openenv_observation_fails_its_episode(
    tokenizer: Any,
) -> None:
    class NaNScore(EchoEnvironment):
        def step(
            self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any
        ) -> EchoObservation:
            return EchoObservation(
                echoed="x", length=1, reward=0.5, metadata={"p": [0.5, -math.inf]}
            )

    harness = RolloutHarness.local(NaNScore(), tokenizer, 2)
    harness.reset()
    assert harness.step(ids(tokenizer, "7")).done
    data = harness.get_episode_data()
    assert data.stop_reason is StopReason.ENV_ERROR
    assert data.info["error"] == (
        "EnvExecutionError: in-process env 'NaNScore', step 1: the env's observation.metadata.p.1 "
        "is -Infinity: replies are JSON, which has no -Infinity; return a finite number "
        "[code EXECUTION_ERROR]"
    )


def test_segments_restart_the_context_as_new_samples(tokenizer: Any) -> None:
    observations = [f"observation number {k} of the long game" for k in range(7)]
    harness = RolloutHarness.local(
        ScriptedEnv(observations),
        tokenizer,
        6,
        segment_prompt_tokens=200,
        restart_keep_turns=1,
        instruction="Play well.",
    )
    harness.reset()
    restarts = []
    completions = []
    for turn in range(6):
        completion = ids(tokenizer, f"move {turn}")
        completions.append(completion)
        result = harness.step(completion)
        if result.new_sample:
            restarts.append(turn)
            assert result.prompt_ids == harness.context_ids
        if not result.done:
            assert len(harness.context_ids) <= 200
    data = harness.get_episode_data()
    assert restarts  # the budget forced at least one restart
    assert len(data.samples) == len(restarts) + 1
    sampled = [s.token_ids[i + 1] for s in data.samples for i, m in enumerate(s.action_mask) if m]
    assert sampled == [t for c in completions for t in c]  # each sampled id in exactly one row
    restart_text = tokenizer.decode(list(data.samples[1].token_ids))
    assert "Play well." in restart_text
    assert "Earlier in this episode you took these actions, in order:\n1. move 0" in restart_text
    kept = restarts[0]  # the latest turn before the restart is kept verbatim
    assert f"<|im_start|>assistant\nmove {kept}<|im_end|>" in restart_text
    with pytest.raises(ValueError, match="this episode has"):
        _ = data.token_ids


def test_tool_calls_go_to_the_tool_and_malformed_ones_never_reach_the_env(tokenizer: Any) -> None:
    harness = RolloutHarness.local(
        ToolEnv(),
        tokenizer,
        3,
        mcp_tool="add",
        observation_processor=lambda o: o.get("prompt") or str(o.get("result", {}).get("data")),
    )
    harness.reset()
    good = harness.step(
        ids(tokenizer, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    )
    assert "5" in tokenizer.decode(good.prompt_ids)
    bad = harness.step(ids(tokenizer, '<tool_call>{"name": "add", "arguments": {"a": 2'))
    assert bad.reward == 0.0
    assert bad.info["malformed_tool_call"] == "a <tool_call> block is not closed"
    feedback = MALFORMED_FEEDBACK.format(reason="a <tool_call> block is not closed")
    assert feedback in tokenizer.decode(bad.prompt_ids)
    assert not bad.done  # the episode goes on, until its turns run out
    last = harness.step(ids(tokenizer, "<tool_call>not json</tool_call>"))
    assert last.done
    data = harness.get_episode_data()
    assert data.stop_reason is StopReason.MAX_TURNS
    assert data.info["malformed_tool_call"].startswith("the tool call is not valid JSON")


def test_action_error_field_is_recorded(tokenizer: Any) -> None:
    class Picky(EchoEnv):
        def step(self, action: str) -> Any:
            observation, reward, done, truncated, info = super().step(action)
            return observation, reward, done, truncated, {**info, "invalid": "not a move"}

    harness = RolloutHarness.local(Picky(), tokenizer, 2, action_error_field="invalid")
    harness.reset()
    assert harness.step(ids(tokenizer, "x")).info["action_error"] == "not a move"


def test_a_template_that_rewrites_earlier_turns_starts_a_new_sample_each_turn(
    tokenizer: Any,
) -> None:
    rewriting = copy.deepcopy(tokenizer)
    rewriting.chat_template = (
        "{%- for m in messages %}{%- set c = m['content'] %}"
        "{%- if m['role'] == 'assistant' and not loop.last %}"
        "{%- set c = c.split('</think>')[-1] %}{%- endif %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    harness = RolloutHarness.local(ScriptedEnv(["q1", "q2", "q3"]), rewriting, 2)
    assert harness.framer.prefix_stable is False
    harness.reset()
    first = ids(rewriting, "<think>hmm</think>A1")
    result = harness.step(first)
    assert result.new_sample
    seen = apply_chat_template(
        rewriting,
        [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "<think>hmm</think>A1"},
            {"role": "user", "content": "q2"},
        ],
    )
    assert result.prompt_ids == seen  # what the policy sees next: the think block is gone
    assert "hmm" not in rewriting.decode(seen)
    second = ids(rewriting, "A2")
    harness.step(second)
    samples = harness.get_episode_data().samples
    assert len(samples) == 2
    assert list(samples[1].token_ids) == seen + second
    for sample, completion in zip(samples, (first, second), strict=True):
        assert [sample.token_ids[i + 1] for i, m in enumerate(sample.action_mask) if m] == (
            completion
        )


def test_strict_and_lenient_chat_template_boundaries(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(ChatTemplateError, match="it has no chat template; give it a chat template"):
        RolloutHarness.local(ScriptedEnv(["a", "b"]), plain, 1).reset()
    with caplog.at_level(logging.WARNING):
        lenient = RolloutHarness.local(
            ScriptedEnv(["a", "b"]), plain, 1, strict_chat_template_boundary=False
        )
        prompt = lenient.reset()
    assert "framing turns as ChatML" in caplog.text
    assert prompt == apply_chat_template(tokenizer, [{"role": "user", "content": "a"}])


def test_raw_text_mode(tokenizer: Any) -> None:
    harness = RolloutHarness.local(
        ScriptedEnv(["Q:", "R:", "S:"]),
        tokenizer,
        2,
        apply_chat_template=False,
        instruction="Answer.",
    )
    assert harness.reset() == tokenizer.encode("Answer.\n\nQ:", add_special_tokens=False)
    assert harness.step(ids(tokenizer, " yes", eos=False)).prompt_ids == tokenizer.encode(
        "R:", add_special_tokens=False
    )


def test_tasks_and_eval_tasks(tokenizer: Any) -> None:
    harness = RolloutHarness.local(
        EchoEnv(), tokenizer, 1, tasks=[{"level": "easy"}], eval_tasks=[{"level": "held-out"}]
    )
    harness.reset(row_index=0)
    assert harness.info["task"] == {"level": "easy", "row_index": 0}
    harness.eval_mode()
    harness.reset(row_index=0)
    assert harness.info["task"] == {"level": "held-out", "row_index": 0}
    with pytest.raises(IndexError, match="row_index 3 is outside the 1 tasks"):
        harness.reset(row_index=3)


def test_logps_must_match_the_sampled_ids(tokenizer: Any) -> None:
    harness = RolloutHarness.local(EchoEnv(), tokenizer, 2)
    with pytest.raises(EnvStateError, match=r"call reset\(\) first"):
        harness.step([5])
    harness.reset()
    with pytest.raises(ValueError, match="sampling_logps has 1 values for 2 sampled ids"):
        harness.step([5, 6], [-1.0])


def test_in_process_and_served_envs_give_identical_episode_data(tokenizer: Any) -> None:
    actions = ["hello", "<think>x</think> y", "stop"]
    local = play(
        RolloutHarness.local(EchoEnv(), tokenizer, 4, system_prompt="S"), tokenizer, actions
    )
    with OpenEnvServer(make_env=EchoEnv, max_concurrent_envs=2) as server:
        remote = play(
            RolloutHarness(server.url, tokenizer, 4, system_prompt="S"), tokenizer, actions
        )
        from_spec = play(
            RolloutHarness.from_spec(
                LLMEnvSpec(env_type="rollout", env_url=server.url, max_turns=4),
                tokenizer,
                system_prompt="S",
            ),
            tokenizer,
            actions,
        )
    entry = play(
        RolloutHarness.from_spec(
            LLMEnvSpec(env_type="rollout", entrypoint="echo_envs:EchoEnv", max_turns=4),
            tokenizer,
            system_prompt="S",
        ),
        tokenizer,
        actions,
    )
    assert local == remote == from_spec == entry
    assert local.stop_reason is StopReason.TERMINATED


class _SystemPromptEnv(ScriptedEnv):
    """A ScriptedEnv that gives its own system prompt in the reset info."""

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        observation, info = super().reset(seed=seed, **task)
        return observation, {**info, "system_prompt": "Answer in one word."}


@pytest.mark.parametrize("case", [None, "llama31"])
def test_an_env_system_prompt_is_shown_in_the_system_role_unless_the_run_sets_one(
    tokenizer: Any, case: str | None
) -> None:
    from real_tokenizers import load_mistral_tokenizer
    from template_corpus import get_case, with_template

    tok = (
        tokenizer
        if case is None
        else with_template(lambda: load_mistral_tokenizer("mistral_v3"), get_case(case))
    )
    env = _SystemPromptEnv(["q1", "q2", "end"])
    harness = RolloutHarness.local(env, tok, max_turns=3)
    ids = harness.reset()
    system = [{"role": "system", "content": "Answer in one word."}]
    expected = tok.apply_chat_template(
        [*system, {"role": "user", "content": "q1"}], add_generation_prompt=True, tokenize=True
    )
    assert ids == list(getattr(expected, "input_ids", expected))
    # the next turn goes on in the same conversation, the system message once at its head
    harness.step([*tok.encode("a", add_special_tokens=False), tok.eos_token_id])
    assert tok.decode(harness.context_ids).count("Answer in one word.") == 1
    own = RolloutHarness.local(env, tok, max_turns=3, system_prompt="Be brief.")
    text = tok.decode(own.reset())
    assert "Be brief." in text
    assert "Answer in one word." not in text
