# ruff: noqa: RUF001 (DeepSeek's tokens are spelt with fullwidth bars, on purpose)
"""The chat-template corpus: each family's exact rendering, its quirks, and ``with_template``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from jinja2.exceptions import TemplateError
from template_corpus import CASES, TEMPLATES_DIR, TemplateCase, get_case, with_template
from transformers import AutoTokenizer

SYSTEM = {"role": "system", "content": "You are terse."}
DIALOGUE = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]
ADD_CALL = {
    "id": "call12345",  # Mistral v0.3 wants 9 characters
    "type": "function",
    "function": {"name": "add", "arguments": {"a": 2, "b": 2}},
}
TOOL_DIALOGUE = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "", "tool_calls": [ADD_CALL]},
    {"role": "tool", "tool_call_id": "call12345", "content": "4"},
]
ADD_SCHEMA = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
LLAMA31_SYSTEM_HEADER = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
)

# The fixed conversation (SYSTEM where the family takes one, then DIALOGUE) with a generation
# prompt, written out by hand from each family's published format.
EXPECTED: dict[str, str] = {
    "chatml_qwen25": (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "qwen3": (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "llama2": (
        "<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nWhat is 2 + 2? [/INST] 4 </s>"
        "<s>[INST] And 3 + 3? [/INST]"
    ),
    "mistral_v01": "<s>[INST] What is 2 + 2? [/INST]4</s>[INST] And 3 + 3? [/INST]",
    "mistral_v03": (
        "<s>[INST] What is 2 + 2?[/INST] 4</s>[INST] You are terse.\n\nAnd 3 + 3?[/INST]"
    ),
    "llama31": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "You are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd 3 + 3?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "gemma": (
        "<bos><start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n"
        "<start_of_turn>model\n4<end_of_turn>\n"
        "<start_of_turn>user\nAnd 3 + 3?<end_of_turn>\n"
        "<start_of_turn>model\n"
    ),
    "deepseek_r1": (
        "<｜begin▁of▁sentence｜>You are terse."
        "<｜User｜>What is 2 + 2?<｜Assistant｜>4<｜end▁of▁sentence｜>"
        "<｜User｜>And 3 + 3?<｜Assistant｜><think>\n"
    ),
    "phi3": (
        "<|system|>\nYou are terse.<|end|>\n"
        "<|user|>\nWhat is 2 + 2?<|end|>\n"
        "<|assistant|>\n4<|end|>\n"
        "<|user|>\nAnd 3 + 3?<|end|>\n"
        "<|assistant|>\n"
    ),
}


@pytest.fixture(scope="session")
def loader(tiny_model_dir: Path) -> Any:
    """A loader of fresh copies of the built-in tiny tokenizer."""
    return lambda: AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def templated(loader: Any) -> dict[str, Any]:
    """One tokenizer per case, shared by the tests that only render."""
    return {c.name: with_template(loader, c) for c in CASES}


def render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    kwargs.setdefault("add_generation_prompt", True)
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def conversation(c: TemplateCase) -> list[dict[str, Any]]:
    return [SYSTEM, *DIALOGUE] if c.system else list(DIALOGUE)


by_case = pytest.mark.parametrize("c", CASES, ids=lambda c: c.name)


# ---- the corpus itself ------------------------------------------------------------------------


def test_every_template_file_is_a_case_and_back() -> None:
    names = [c.name for c in CASES]
    assert len(set(names)) == len(names)
    assert {p.stem for p in TEMPLATES_DIR.glob("*.jinja")} == set(names)
    assert set(EXPECTED) == set(names)
    assert get_case("gemma").name == "gemma"
    with pytest.raises(KeyError, match="no template case"):
        get_case("nope")


@by_case
def test_case_fields_are_consistent(c: TemplateCase) -> None:
    assert c.template == (TEMPLATES_DIR / f"{c.name}.jinja").read_text(encoding="utf-8").rstrip()
    assert c.eos_token in c.special_tokens
    assert c.bos_token is None or c.bos_token in c.special_tokens
    assert not set(c.special_tokens) & set(c.added_tokens)
    if c.reasoning is not None:
        assert set(c.reasoning) <= set(c.single_tokens)


# ---- the pinned renderings --------------------------------------------------------------------


@by_case
def test_pinned_rendering(c: TemplateCase, templated: dict[str, Any]) -> None:
    assert render(templated[c.name], conversation(c)) == EXPECTED[c.name]


@by_case
def test_rendering_starts_with_bos_only_where_the_family_has_one(
    c: TemplateCase, templated: dict[str, Any]
) -> None:
    text = render(templated[c.name], conversation(c))
    if c.bos_token is None:
        assert templated[c.name].bos_token is None
    else:
        assert text.startswith(c.bos_token)
        assert templated[c.name].bos_token == c.bos_token


@by_case
def test_tokenized_rendering_round_trips(c: TemplateCase, templated: dict[str, Any]) -> None:
    tok = templated[c.name]
    out = tok.apply_chat_template(conversation(c), tokenize=True, add_generation_prompt=True)
    ids = list(out["input_ids"])
    assert tok.decode(ids) == EXPECTED[c.name]
    for token in c.single_tokens:
        if token in EXPECTED[c.name]:
            assert tok.convert_tokens_to_ids(token) in ids, token


@by_case
def test_system_role_support(c: TemplateCase, templated: dict[str, Any]) -> None:
    if c.system:
        assert "You are terse." in render(templated[c.name], [SYSTEM, *DIALOGUE])
    else:
        with pytest.raises(TemplateError):
            render(templated[c.name], [SYSTEM, *DIALOGUE])


# ---- with_template ----------------------------------------------------------------------------


@by_case
def test_with_template_adds_the_special_tokens(c: TemplateCase, templated: dict[str, Any]) -> None:
    tok = templated[c.name]
    ok = tok.encode("ok", add_special_tokens=False)
    assert tok.chat_template == c.template
    assert tok.eos_token == c.eos_token
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == c.eos_token
    for token in c.special_tokens:
        ids = tok.encode(token, add_special_tokens=False)
        assert len(ids) == 1, token
        assert tok.convert_ids_to_tokens(ids[0]) == token
        assert ids[0] in tok.all_special_ids, token
        assert tok.decode([*ids, *ok], skip_special_tokens=True) == "ok"
    for token in c.added_tokens:  # whole, yet kept by skip_special_tokens like the real ones
        ids = tok.encode(token, add_special_tokens=False)
        assert len(ids) == 1, token
        assert tok.decode(ids, skip_special_tokens=True) == token


def test_with_template_keeps_existing_single_tokens(loader: Any) -> None:
    base = loader()
    tok = with_template(loader, get_case("chatml_qwen25"))
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tok.convert_tokens_to_ids(token) == base.convert_tokens_to_ids(token)
    assert len(tok) == len(base) + 2  # only <tool_call> and </tool_call> are new


def test_with_template_leaves_other_tokenizers_alone(loader: Any, tiny_model_dir: Path) -> None:
    def state(tok: Any) -> tuple[Any, ...]:
        return (len(tok), tok.chat_template, tok.eos_token, tok.bos_token, tok.all_special_tokens)

    base = loader()
    before = state(base)
    made = [with_template(loader, c) for c in CASES]
    assert state(base) == before
    assert state(loader()) == before
    assert len({id(t) for t in made}) == len(made)
    assert made[0].chat_template != made[-1].chat_template

    copied = with_template(base, get_case("gemma"))  # a tokenizer itself is copied
    assert copied is not base
    assert state(base) == before
    assert copied.chat_template == get_case("gemma").template

    from_dir = with_template(tiny_model_dir, get_case("llama31"))
    assert from_dir.eos_token == "<|eot_id|>"
    assert state(loader()) == before


def test_with_template_rejects_what_is_not_a_tokenizer_source() -> None:
    with pytest.raises(TypeError, match="not a tokenizer"):
        with_template(lambda: "nope", get_case("gemma"))
    with pytest.raises(TypeError, match="expected a tokenizer"):
        with_template(3, get_case("gemma"))


# ---- Qwen2.5 ----------------------------------------------------------------------------------


def test_qwen25_default_system_prompt(templated: dict[str, Any]) -> None:
    assert render(templated["chatml_qwen25"], [{"role": "user", "content": "Hi"}]) == (
        f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen25_tools_go_into_the_system_message(templated: dict[str, Any]) -> None:
    text = render(
        templated["chatml_qwen25"], [{"role": "user", "content": "Hi"}], tools=[ADD_SCHEMA]
    )
    assert text == (
        f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{json.dumps(ADD_SCHEMA)}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = render(templated["chatml_qwen25"], [SYSTEM, DIALOGUE[0]], tools=[ADD_SCHEMA])
    assert with_system.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n\n")
    assert QWEN_DEFAULT_SYSTEM not in with_system


def test_qwen25_tool_calls_and_tool_responses(templated: dict[str, Any]) -> None:
    assert render(templated["chatml_qwen25"], TOOL_DIALOGUE) == (
        f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen25_groups_consecutive_tool_messages_in_one_user_block(
    templated: dict[str, Any],
) -> None:
    messages = [*TOOL_DIALOGUE, {"role": "tool", "tool_call_id": "call12345", "content": "four"}]
    assert render(templated["chatml_qwen25"], [SYSTEM, *messages]).endswith(
        "<|im_start|>user\n<tool_response>\n4\n</tool_response>\n"
        "<tool_response>\nfour\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


# ---- Qwen3 ------------------------------------------------------------------------------------


THINKING_DIALOGUE = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "<think>\nadd again\n</think>\n\n6"},
]


def test_qwen3_has_no_default_system_prompt(templated: dict[str, Any]) -> None:
    assert render(templated["qwen3"], [{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen3_strips_reasoning_before_the_last_user_query_only(templated: dict[str, Any]) -> None:
    text = render(templated["qwen3"], THINKING_DIALOGUE, add_generation_prompt=False)
    assert text == (
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nadd again\n</think>\n\n6<|im_end|>\n"
    )


def test_qwen3_final_answer_gets_an_empty_think_block(templated: dict[str, Any]) -> None:
    messages = [*DIALOGUE, {"role": "assistant", "content": "6"}]
    assert render(templated["qwen3"], messages, add_generation_prompt=False).endswith(
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n6<|im_end|>\n"
    )


def test_qwen3_reads_reasoning_content(templated: dict[str, Any]) -> None:
    messages = [
        DIALOGUE[0],
        {"role": "assistant", "content": "4", "reasoning_content": "add them"},
    ]
    assert render(templated["qwen3"], messages, add_generation_prompt=False) == (
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>\n"
    )


def test_qwen3_keeps_reasoning_through_a_multi_step_tool_turn(templated: dict[str, Any]) -> None:
    messages = [
        DIALOGUE[0],
        {
            "role": "assistant",
            "content": "<think>\nuse the tool\n</think>\n\n",
            "tool_calls": [ADD_CALL],
        },
        {"role": "tool", "tool_call_id": "call12345", "content": "4"},
        {"role": "assistant", "content": "<think>\nthe tool said 4\n</think>\n\n4"},
    ]
    assert render(templated["qwen3"], messages, add_generation_prompt=False) == (
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nuse the tool\n</think>\n\n<tool_call>\n"
        '{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nthe tool said 4\n</think>\n\n4<|im_end|>\n"
    )


def test_qwen3_enable_thinking_false(templated: dict[str, Any]) -> None:
    messages = [DIALOGUE[0]]
    assert render(templated["qwen3"], messages, enable_thinking=False) == (
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert render(templated["qwen3"], messages, enable_thinking=True) == (
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen3_tool_role(templated: dict[str, Any]) -> None:
    assert render(templated["qwen3"], TOOL_DIALOGUE) == (
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


# ---- Llama 2 ----------------------------------------------------------------------------------


def test_llama2_strips_content_and_closes_answers_with_space_eos(
    templated: dict[str, Any],
) -> None:
    messages = [
        {"role": "user", "content": "  What is 2 + 2?\n"},
        {"role": "assistant", "content": "\n 4  "},
        {"role": "user", "content": "And 3 + 3? "},
        {"role": "assistant", "content": "6"},
    ]
    assert render(templated["llama2"], messages, add_generation_prompt=False) == (
        "<s>[INST] What is 2 + 2? [/INST] 4 </s><s>[INST] And 3 + 3? [/INST] 6 </s>"
    )


def test_llama2_has_no_generation_prompt(templated: dict[str, Any]) -> None:
    with_prompt = render(templated["llama2"], [SYSTEM, *DIALOGUE], add_generation_prompt=True)
    assert with_prompt == render(
        templated["llama2"], [SYSTEM, *DIALOGUE], add_generation_prompt=False
    )


def test_llama2_enforces_alternation(templated: dict[str, Any]) -> None:
    with pytest.raises(TemplateError, match="Conversation roles must alternate"):
        render(templated["llama2"], [DIALOGUE[0], DIALOGUE[0]])


# ---- Mistral ----------------------------------------------------------------------------------


def test_mistral_v01_raises_on_system(templated: dict[str, Any]) -> None:
    with pytest.raises(TemplateError, match="Conversation roles must alternate"):
        render(templated["mistral_v01"], [SYSTEM, *DIALOGUE])


def test_mistral_v01_raises_on_tool(templated: dict[str, Any]) -> None:
    with pytest.raises(TemplateError, match="Only user and assistant roles are supported!"):
        render(templated["mistral_v01"], [DIALOGUE[0], TOOL_DIALOGUE[2]])


def test_mistral_v03_puts_the_system_prompt_in_the_last_user_turn_only(
    templated: dict[str, Any],
) -> None:
    tok = templated["mistral_v03"]
    assert render(tok, [SYSTEM, DIALOGUE[0]]) == "<s>[INST] You are terse.\n\nWhat is 2 + 2?[/INST]"
    # The same first turn, once the dialogue has moved on: the system prompt has moved with it.
    assert render(tok, [SYSTEM, *DIALOGUE]).startswith("<s>[INST] What is 2 + 2?[/INST] 4</s>")
    # It is dropped altogether when the last message is not a user's.
    closed = render(tok, [SYSTEM, *DIALOGUE[:2]], add_generation_prompt=False)
    assert closed == "<s>[INST] What is 2 + 2?[/INST] 4</s>"


def test_mistral_v03_trims_answers(templated: dict[str, Any]) -> None:
    messages = [DIALOGUE[0], {"role": "assistant", "content": "\n4 "}]
    assert render(templated["mistral_v03"], messages) == "<s>[INST] What is 2 + 2?[/INST] 4</s>"


def test_mistral_v03_tool_calls_and_results(templated: dict[str, Any]) -> None:
    assert render(templated["mistral_v03"], TOOL_DIALOGUE) == (
        "<s>[INST] What is 2 + 2?[/INST]"
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 2}, "id": "call12345"}]</s>'
        '[TOOL_RESULTS] {"content": 4, "call_id": "call12345"}[/TOOL_RESULTS]'
    )


def test_mistral_v03_wants_nine_character_tool_call_ids(templated: dict[str, Any]) -> None:
    messages = [*TOOL_DIALOGUE[:2], {**TOOL_DIALOGUE[2], "tool_call_id": "call_1"}]
    with pytest.raises(TemplateError, match="length 9"):
        render(templated["mistral_v03"], messages)


# ---- Llama 3.1 --------------------------------------------------------------------------------


def test_llama31_default_system_block(templated: dict[str, Any]) -> None:
    assert render(templated["llama31"], [{"role": "user", "content": "Hi"}]) == (
        LLAMA31_SYSTEM_HEADER + "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    dated = render(
        templated["llama31"], [{"role": "user", "content": "Hi"}], date_string="1 Jan 2025"
    )
    assert "Today Date: 1 Jan 2025\n\n<|eot_id|>" in dated


def test_llama31_trims_content(templated: dict[str, Any]) -> None:
    messages = [
        {"role": "system", "content": "\nYou are terse. "},
        {"role": "user", "content": "  What is 2 + 2?\n\n"},
        {"role": "assistant", "content": " 4\n"},
    ]
    assert render(templated["llama31"], messages, add_generation_prompt=False) == (
        LLAMA31_SYSTEM_HEADER + "You are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>"
    )


def test_llama31_renders_the_tool_role_as_ipython(templated: dict[str, Any]) -> None:
    assert render(templated["llama31"], TOOL_DIALOGUE) == (
        LLAMA31_SYSTEM_HEADER + "<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>"
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "add", "parameters": '
        '{"a": 2, "b": 2}}<|eot_id|>'
        # A string is "iterable" to Jinja, so the tool's text goes through tojson: quoted.
        '<|start_header_id|>ipython<|end_header_id|>\n\n"4"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_llama31_tools_go_into_the_first_user_message(templated: dict[str, Any]) -> None:
    text = render(templated["llama31"], [DIALOGUE[0]], tools=[ADD_SCHEMA])
    assert text.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    )
    assert text.endswith(
        f"{json.dumps(ADD_SCHEMA, indent=4)}\n\nWhat is 2 + 2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


# ---- Gemma ------------------------------------------------------------------------------------


def test_gemma_raises_on_system(templated: dict[str, Any]) -> None:
    with pytest.raises(TemplateError, match="System role not supported"):
        render(templated["gemma"], [SYSTEM, *DIALOGUE])


def test_gemma_trims_and_calls_the_assistant_model(templated: dict[str, Any]) -> None:
    messages = [{"role": "user", "content": " Hi\n"}, {"role": "assistant", "content": "\nHello "}]
    assert render(templated["gemma"], messages, add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
    )


def test_gemma_enforces_alternation(templated: dict[str, Any]) -> None:
    with pytest.raises(TemplateError, match="Conversation roles must alternate"):
        render(templated["gemma"], [DIALOGUE[0], DIALOGUE[0]])


def test_gemma_turns_end_with_end_of_turn_while_eos_is_eos(templated: dict[str, Any]) -> None:
    assert templated["gemma"].eos_token == "<eos>"
    assert "<eos>" not in render(templated["gemma"], DIALOGUE, add_generation_prompt=False)


# ---- DeepSeek-R1 ------------------------------------------------------------------------------


def test_deepseek_r1_generation_prompt_opens_a_think_block(templated: dict[str, Any]) -> None:
    text = render(templated["deepseek_r1"], [DIALOGUE[0]])
    assert text == "<｜begin▁of▁sentence｜><｜User｜>What is 2 + 2?<｜Assistant｜><think>\n"
    assert text.endswith("<think>\n")
    closed = render(templated["deepseek_r1"], DIALOGUE[:2], add_generation_prompt=False)
    assert closed.endswith("<｜Assistant｜>4<｜end▁of▁sentence｜>")


def test_deepseek_r1_strips_reasoning_and_hoists_system_messages(templated: dict[str, Any]) -> None:
    messages = [
        SYSTEM,
        DIALOGUE[0],
        {"role": "system", "content": "Be exact."},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        DIALOGUE[2],
    ]
    # Everything up to the last </think> goes, the blank line after it stays.
    assert render(templated["deepseek_r1"], messages) == (
        "<｜begin▁of▁sentence｜>You are terse.\n\nBe exact."
        "<｜User｜>What is 2 + 2?<｜Assistant｜>\n\n4<｜end▁of▁sentence｜>"
        "<｜User｜>And 3 + 3?<｜Assistant｜><think>\n"
    )


def test_deepseek_r1_tool_calls_and_outputs(templated: dict[str, Any]) -> None:
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
    messages = [
        DIALOGUE[0],
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "4"},
    ]
    # No generation prompt after tool outputs: the model continues from the outputs' end.
    assert render(templated["deepseek_r1"], messages) == (
        "<｜begin▁of▁sentence｜><｜User｜>What is 2 + 2?"
        "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n"
        '```json\n{"a": 2, "b": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>4<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    )


# ---- Phi-3 ------------------------------------------------------------------------------------


def test_phi3_turns_end_with_end_while_eos_is_endoftext(templated: dict[str, Any]) -> None:
    tok = templated["phi3"]
    assert tok.eos_token == "<|endoftext|>"
    assert render(tok, DIALOGUE[:2], add_generation_prompt=False) == (
        "<|user|>\nWhat is 2 + 2?<|end|>\n<|assistant|>\n4<|end|>\n<|endoftext|>"
    )
    assert "<|endoftext|>" not in render(tok, DIALOGUE[:2])


def test_phi3_drops_tool_messages(templated: dict[str, Any]) -> None:
    assert render(templated["phi3"], [DIALOGUE[0], TOOL_DIALOGUE[2]]) == (
        "<|user|>\nWhat is 2 + 2?<|end|>\n<|assistant|>\n"
    )


@by_case
def test_tool_role_flag_matches_the_rendering(c: TemplateCase, templated: dict[str, Any]) -> None:
    """Families with a tool format render the tool's text; the others raise or drop it."""
    tool = {"role": "tool", "tool_call_id": "call12345", "content": "tool says hi"}
    messages = [DIALOGUE[0], {"role": "assistant", "content": "", "tool_calls": [ADD_CALL]}, tool]
    if c.name == "deepseek_r1":
        call = {**ADD_CALL, "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
        messages[1] = {"role": "assistant", "content": "", "tool_calls": [call]}
    if c.tool_role:
        assert "tool says hi" in render(templated[c.name], messages)
        return
    try:
        text = render(templated[c.name], messages)
    except TemplateError:
        return
    assert "tool says hi" not in text
