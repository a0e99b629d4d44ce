"""Pinned cases of the ways real chat templates and tool-call formats broke token exactness.

Each test is one defect as it was reported; the expected ids are derived by hand from the
template's text and the tokenizer's rules (written next to each).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import datasets
import pytest
from echo_envs import ScriptedEnv, ToolEnv
from real_tokenizers import load_mistral_tokenizer
from template_corpus import get_case, with_template

from agile_llmenvs.llm_envs import DatasetEnv, RolloutHarness, StopReason, apply_chat_template

pytest.importorskip("sentencepiece")
pytest.importorskip("mistral_common")

_TINY: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def _tiny(tiny_model_dir: Path) -> None:
    _TINY[:] = [tiny_model_dir]


@cache
def templated(tokenizer_name: str, case_name: str) -> Any:
    loader: Callable[[], Any]
    if tokenizer_name == "tiny":
        from transformers import AutoTokenizer

        def loader() -> Any:
            return AutoTokenizer.from_pretrained(_TINY[0])
    else:

        def loader() -> Any:
            return load_mistral_tokenizer(tokenizer_name)

    return with_template(loader, get_case(case_name))


def words(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def pieces(tokenizer: Any, ids: Any) -> list[str]:
    return list(tokenizer.convert_ids_to_tokens(list(ids)))


# -- framing -----------------------------------------------------------------------------------


def test_llama2_completion_ending_in_its_own_eos_gets_no_second_eos() -> None:
    tokenizer = templated("mistral_v1", "llama2")
    harness = RolloutHarness.local(ScriptedEnv(["a", "b", "c"]), tokenizer, 2)
    harness.reset()
    closed = harness.step([*words(tokenizer, "four"), tokenizer.eos_token_id])
    # After an answer Llama-2 renders ' </s>' then '<s>[INST] b [/INST]'; the answer's own
    # </s> stands for ' </s>'. After <s> SentencePiece marks no word start, so '[INST]' is
    # '[', 'INST', ']' and ' b' is '▁b'.
    assert pieces(tokenizer, closed.prompt_ids) == [
        "<s>", "[", "INST", "]", "▁b", "▁[", "/", "INST", "]",
    ]  # fmt: skip
    cut = harness.step(words(tokenizer, "five"))  # cut by max tokens: no eos of its own
    assert cut.done
    ids = harness.get_episode_data().samples[0].token_ids
    assert list(ids).count(tokenizer.eos_token_id) == 1


def test_llama2_completion_cut_without_eos_gets_the_templates_close() -> None:
    tokenizer = templated("mistral_v1", "llama2")
    harness = RolloutHarness.local(ScriptedEnv(["a", "b", "c"]), tokenizer, 2)
    harness.reset()
    cut = harness.step(words(tokenizer, "four"))
    # ' </s>' inside a rendering: '▁', '</s>'; then '<s>[INST] b [/INST]' as above.
    assert pieces(tokenizer, cut.prompt_ids) == [
        "▁", "</s>", "<s>", "[", "INST", "]", "▁b", "▁[", "/", "INST", "]",
    ]  # fmt: skip


def test_mistral_v03_moves_the_system_prompt_so_a_system_conversation_re_renders() -> None:
    tokenizer = templated("mistral_v3", "mistral_v03")
    harness = RolloutHarness.local(
        ScriptedEnv(["a", "the obs", "c"]), tokenizer, 2, system_prompt="Be brief."
    )
    assert harness.framer.appendable(system=False)
    assert not harness.framer.appendable(system=True)  # probed with a system message
    harness.reset()
    result = harness.step([*words(tokenizer, "four"), tokenizer.eos_token_id])
    assert result.new_sample
    seen = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "the obs"},
    ]
    # v0.3 puts the system prompt in the last user turn only: it left the first one.
    text = "<s>[INST] a[/INST] four</s>[INST] Be brief.\n\nthe obs[/INST]"
    assert tokenizer.apply_chat_template(seen, tokenize=False, add_generation_prompt=True) == text
    assert result.prompt_ids == apply_chat_template(tokenizer, seen)


@pytest.mark.parametrize(
    ("tokenizer_name", "case_name", "expected"),
    [
        # v3: [INST] and [/INST] are control tokens; ' the obs' is '▁the', '▁obs' in one piece
        ("mistral_v3", "mistral_v03", ["[INST]", "▁the", "▁obs", "[/INST]"]),
        # v1 under v0.1's template: '[INST]' is text, tokenized after </s> (no word start)
        ("mistral_v1", "mistral_v01", ["[", "INST", "]", "▁the", "▁obs", "▁[", "/", "INST", "]"]),
    ],
)
def test_the_turn_is_tokenized_whole_not_piece_by_piece(
    tokenizer_name: str, case_name: str, expected: list[str]
) -> None:
    tokenizer = templated(tokenizer_name, case_name)
    harness = RolloutHarness.local(ScriptedEnv(["a", "the obs", "c"]), tokenizer, 2)
    harness.reset()
    result = harness.step([*words(tokenizer, "four"), tokenizer.eos_token_id])
    assert pieces(tokenizer, result.prompt_ids) == expected
    # never a lone word-start piece before the observation ('[INST]', '▁', '▁the')
    assert "▁" not in pieces(tokenizer, result.prompt_ids)


def test_llama31_trims_observations_and_the_harness_does_too() -> None:
    tokenizer = templated("tiny", "llama31")
    harness = RolloutHarness.local(ScriptedEnv(["x = 1\n", " done\n", "c"]), tokenizer, 2)
    first = harness.reset()
    assert first == apply_chat_template(tokenizer, [{"role": "user", "content": "x = 1\n"}])
    assert "x = 1<|eot_id|>" in tokenizer.decode(first)  # trimmed
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    result = harness.step([*words(tokenizer, "ok"), eot])
    assert tokenizer.decode(result.prompt_ids) == (
        "<|start_header_id|>user<|end_header_id|>\n\ndone<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


# -- segment budget ----------------------------------------------------------------------------


@pytest.mark.parametrize("case_name", ["chatml_qwen25", "qwen3"])  # prefix-stable or not
def test_segment_prompt_tokens_bounds_every_prompt(case_name: str) -> None:
    tokenizer = templated("tiny", case_name)
    observations = [f"observation {k}: the board has changed again" for k in range(13)]
    budget = 150
    harness = RolloutHarness.local(
        ScriptedEnv(observations), tokenizer, 12, segment_prompt_tokens=budget, instruction="Go."
    )
    assert len(harness.reset()) <= budget
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    restarts = 0
    for turn in range(12):
        result = harness.step([*words(tokenizer, f"<think>hmm</think>move {turn}"), end])
        if result.done:
            break
        assert len(harness.context_ids) <= budget  # the prompt the policy sees next
        restarts += "restart" in result.info or result.new_sample
    data = harness.get_episode_data()
    assert data.stop_reason is StopReason.TERMINATED
    summary = data.info["restart"]
    assert summary["prompt_tokens"] <= budget
    assert summary["dropped_actions"] > 0  # the restart prompt itself was fitted
    if case_name == "chatml_qwen25":
        assert restarts < 11  # not once over budget, every turn restarting


def test_a_first_prompt_over_segment_prompt_tokens_ends_the_episode() -> None:
    tokenizer = templated("tiny", "chatml_qwen25")
    harness = RolloutHarness.local(
        ScriptedEnv(["word " * 80, "b"]), tokenizer, 1, segment_prompt_tokens=40
    )
    prompt = harness.reset()
    assert harness.done
    info = harness.get_episode_data().info["prompt_limit"]
    assert info == {"prompt_tokens": len(prompt), "segment_prompt_tokens": 40}


def test_an_observation_no_restart_can_fit_ends_the_episode_with_the_reason() -> None:
    tokenizer = templated("tiny", "chatml_qwen25")
    harness = RolloutHarness.local(
        ScriptedEnv(["a", "word " * 80, "c"]), tokenizer, 2, segment_prompt_tokens=60
    )
    harness.reset()
    result = harness.step(words(tokenizer, "x"))
    assert result.done
    data = harness.get_episode_data()
    assert data.stop_reason is StopReason.CONTEXT_LIMIT
    assert data.info["segment_limit"]["segment_prompt_tokens"] == 60
    assert data.info["segment_limit"]["restart_prompt_tokens"] > 60


# -- SFT / DPO targets -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case_name", "end"),
    [("gemma", "<end_of_turn>"), ("phi3", "<|end|>"), ("chatml_qwen25", "<|im_end|>")],
)
def test_sft_and_dpo_targets_end_with_the_templates_end_of_turn(case_name: str, end: str) -> None:
    tokenizer = templated("tiny", case_name)
    if case_name == "chatml_qwen25":  # a Qwen-style tokenizer whose eos is not the turn's end
        tokenizer.eos_token = "<|endoftext|>"
    end_id = tokenizer.convert_tokens_to_ids(end)
    assert tokenizer.eos_token_id != end_id
    rows = datasets.Dataset.from_list([{"prompt": "Hi", "response": "Hello."}])
    empty = datasets.Dataset.from_list([])
    batch = DatasetEnv(rows, empty, tokenizer, objective="sft").next_batch()
    length = int(batch.attention_mask[0].sum())
    assert batch.input_ids[0, length - 1].item() == end_id
    pairs = datasets.Dataset.from_list([{"prompt": "Hi", "chosen": "Yes.", "rejected": "No."}])
    preference = DatasetEnv(pairs, empty, tokenizer, objective="preference").next_batch()
    for ids, mask in (
        (preference.chosen_input_ids, preference.chosen_attention_mask),
        (preference.rejected_input_ids, preference.rejected_attention_mask),
    ):
        assert ids[0, int(mask[0].sum()) - 1].item() == end_id


@pytest.mark.parametrize(
    ("tokenizer_name", "case_name", "end"),
    [
        ("mistral_v1", "llama2", "</s>"),  # '[/INST] Hello there. </s>': the gap and ' </s>'
        ("mistral_v3", "mistral_v03", "</s>"),
        ("tiny", "gemma", "<end_of_turn>"),
    ],
)
def test_an_sft_row_is_the_templates_own_rendering_of_the_turn(
    tokenizer_name: str, case_name: str, end: str
) -> None:
    tokenizer = templated(tokenizer_name, case_name)
    rows = datasets.Dataset.from_list([{"prompt": "Hi", "response": "Hello there."}])
    env = DatasetEnv(rows, datasets.Dataset.from_list([]), tokenizer, objective="sft")
    sft = env.next_batch()
    length = int(sft.attention_mask[0].sum())
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    rendered = apply_chat_template(tokenizer, messages, add_generation_prompt=False)
    # the whole conversation tokenized in one call, up to the turn's end-of-turn token
    assert sft.input_ids[0, :length].tolist() == rendered[:length]
    assert pieces(tokenizer, rendered[length - 1 : length]) == [end]


# -- tool calls --------------------------------------------------------------------------------


def _tool_harness(tokenizer: Any, **settings: Any) -> tuple[Any, RolloutHarness]:
    env = ToolEnv()
    harness = RolloutHarness.local(
        env,
        tokenizer,
        3,
        mcp_tool="add",
        observation_processor=lambda o: o.get("prompt") or str(o.get("result", {}).get("data")),
        **settings,
    )
    harness.reset()
    return env, harness


def _call(name: str, a: int, b: int) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


def test_every_tool_call_runs_in_order_and_each_result_goes_back_in_the_tool_role() -> None:
    tokenizer = templated("tiny", "chatml_qwen25")
    env, harness = _tool_harness(tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    result = harness.step([*words(tokenizer, _call("add", 2, 3) + "\n" + _call("mul", 4, 5)), end])
    assert env.calls == [("add", 2, 3), ("mul", 4, 5)]
    assert result.info["tool_calls"] == [
        {"name": "add", "reward": 0.0},
        {"name": "mul", "reward": 0.0},
    ]
    # Qwen2.5 groups consecutive tool messages in one user turn, each in <tool_response>
    assert tokenizer.decode(result.prompt_ids) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n"
        "<tool_response>\n20\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_tool_results_go_back_as_one_user_turn_for_a_template_without_a_tool_role() -> None:
    tokenizer = templated("mistral_v1", "llama2")
    env, harness = _tool_harness(tokenizer)
    completion = [
        *words(tokenizer, _call("add", 2, 3) + _call("mul", 4, 5)),
        tokenizer.eos_token_id,
    ]
    result = harness.step(completion)
    assert env.calls == [("add", 2, 3), ("mul", 4, 5)]
    assert tokenizer.decode(result.prompt_ids) == "<s>[INST] 5\n\n20 [/INST]"


def test_a_tool_call_mentioned_or_drafted_in_reasoning_is_not_a_call() -> None:
    tokenizer = templated("tiny", "qwen3")
    env, harness = _tool_harness(tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    mentioned = "<think>I could write <tool_call> here</think>" + _call("add", 2, 3)
    first = harness.step([*words(tokenizer, mentioned), end])
    assert "malformed_tool_call" not in first.info
    drafted = "<think>draft: " + _call("mul", 100, 100) + "</think>" + _call("add", 1, 1)
    harness.step([*words(tokenizer, drafted), end])
    assert env.calls == [("add", 2, 3), ("add", 1, 1)]


def test_mistral_tool_calls_are_read_from_the_control_token() -> None:
    tokenizer = templated("mistral_v3", "mistral_v03")
    env, harness = _tool_harness(tokenizer, tool_call_parser="mistral")
    marker = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    assert marker == 5  # a control token of the v3 model: decoding without specials drops it
    body = words(tokenizer, '[{"name": "mul", "arguments": {"a": 6, "b": 7}}]')
    result = harness.step([marker, *body, tokenizer.eos_token_id])
    assert env.calls == [("mul", 6, 7)]
    assert result.info["tool_calls"] == [{"name": "mul", "reward": 0.0}]


def test_a_malformed_call_keeps_its_reason_in_info_and_reaches_no_tool() -> None:
    tokenizer = templated("tiny", "chatml_qwen25")
    env, harness = _tool_harness(tokenizer, tool_call_parser="pythonic")
    result = harness.step(words(tokenizer, "[add(2, b=3)]"))
    assert env.calls == []
    reason = "the call to add has a positional argument (only keyword arguments are allowed)"
    assert result.info["malformed_tool_call"] == reason
    assert result.reward == 0.0


def test_an_unknown_tool_call_parser_is_refused_with_the_known_ones() -> None:
    tokenizer = templated("tiny", "chatml_qwen25")
    with pytest.raises(ValueError, match="tool_call_parser 'qwen' is not one of"):
        RolloutHarness.local(ScriptedEnv(["a"]), tokenizer, 1, tool_call_parser="qwen")


# -- reasoning ---------------------------------------------------------------------------------


def test_the_env_gets_the_action_without_reasoning_and_training_keeps_it() -> None:
    tokenizer = templated("tiny", "qwen3")
    env = ScriptedEnv(["a", "b"])
    harness = RolloutHarness.local(env, tokenizer, 1)
    harness.reset()
    completion = [*words(tokenizer, "<think>2+2 is 4</think>4"), tokenizer.eos_token_id]
    harness.step(completion)
    assert env.actions == ["4"]
    sample = harness.get_episode_data().samples[0]
    assert list(sample.token_ids[-len(completion) :]) == completion


def test_a_generation_prompt_that_opens_reasoning_is_stripped_up_to_its_close() -> None:
    tokenizer = templated("tiny", "deepseek_r1")
    env = ScriptedEnv(["a", "b"])
    harness = RolloutHarness.local(env, tokenizer, 1)
    assert harness.framer.starts_in_reasoning
    harness.reset()
    harness.step([*words(tokenizer, "plan it</think>\n\n7"), tokenizer.eos_token_id])
    assert env.actions == ["\n\n7"]


def test_strip_reasoning_off_sends_the_whole_text() -> None:
    tokenizer = templated("tiny", "qwen3")
    env = ScriptedEnv(["a", "b"])
    harness = RolloutHarness.local(env, tokenizer, 1, strip_reasoning=False)
    harness.reset()
    harness.step([*words(tokenizer, "<think>hm</think>4"), tokenizer.eos_token_id])
    assert env.actions == ["<think>hm</think>4"]


class _ToolMessagesEnv:
    """A text env whose step reports its observation as messages: two tool results, then a
    user message (as the verifiers adapter reports a ToolEnv's turn)."""

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        return "What are 2+3 and 4*5?", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        messages = [
            {"role": "tool", "content": "5"},
            {"role": "tool", "content": "20"},
            {"role": "user", "content": "Anything else?"},
        ]
        return "5\n\n20\n\nAnything else?", 0.0, False, False, {"messages": messages}

    def close(self) -> None:
        pass


def test_a_text_env_step_messages_go_back_in_the_template_tool_role() -> None:
    tokenizer = templated("tiny", "chatml_qwen25")
    harness = RolloutHarness.local(_ToolMessagesEnv(), tokenizer, 3)
    harness.reset()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    result = harness.step([*words(tokenizer, "I will check."), end])
    # Qwen2.5: the tool results in one user turn, each in <tool_response>; then the user turn
    assert tokenizer.decode(result.prompt_ids) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n"
        "<tool_response>\n20\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nAnything else?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_step_messages_fall_back_to_the_observation_text_without_a_tool_role() -> None:
    tokenizer = templated("mistral_v1", "llama2")
    harness = RolloutHarness.local(_ToolMessagesEnv(), tokenizer, 3)
    harness.reset()
    result = harness.step([*words(tokenizer, "I will check."), tokenizer.eos_token_id])
    assert tokenizer.decode(result.prompt_ids) == "<s>[INST] 5\n\n20\n\nAnything else? [/INST]"
