"""The tool-call parsers: every format's calls, in order; malformed calls; reasoning ignored."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from agile_llmenvs.llm_envs.tool_calls import (
    TOOL_CALL_PARSERS,
    ParsedAction,
    ToolCall,
    parse_tool_calls,
    strip_reasoning,
)

SEARCH = ToolCall("search", {"q": "cats", "limit": 3})
WEATHER = ToolCall("weather", {"city": "Paris"})
DRAFT = ToolCall("delete_everything", {"really": True})


def _hermes(calls: Sequence[ToolCall]) -> str:
    return "\n".join(
        f"<tool_call>{json.dumps({'name': c.name, 'arguments': c.arguments})}</tool_call>"
        for c in calls
    )


def _llama3_json(calls: Sequence[ToolCall]) -> str:
    return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}) for c in calls)


def _mistral(calls: Sequence[ToolCall]) -> str:
    return "[TOOL_CALLS]" + json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls])


def _pythonic(calls: Sequence[ToolCall]) -> str:
    def call(c: ToolCall) -> str:
        return f"{c.name}({', '.join(f'{k}={v!r}' for k, v in c.arguments.items())})"

    return "[" + ", ".join(call(c) for c in calls) + "]"


RENDER: dict[str, Callable[[Sequence[ToolCall]], str]] = {
    "hermes": _hermes,
    "llama3_json": _llama3_json,
    "mistral": _mistral,
    "pythonic": _pythonic,
}


def calls(*found: ToolCall) -> ParsedAction:
    return ParsedAction(tuple(found))


def malformed(error: str, *before: ToolCall) -> ParsedAction:
    return ParsedAction(tuple(before), error)


def test_the_parsers_are_named() -> None:
    assert TOOL_CALL_PARSERS == ("hermes", "llama3_json", "mistral", "pythonic")
    assert set(RENDER) == set(TOOL_CALL_PARSERS)


def test_an_unknown_parser_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown tool-call parser 'qwen'") as info:
        parse_tool_calls("x", "qwen")
    assert str(info.value) == (
        "unknown tool-call parser 'qwen' (known parsers: hermes, llama3_json, mistral, pythonic)"
    )


def test_has_calls() -> None:
    assert not ParsedAction().has_calls
    assert calls(SEARCH).has_calls
    assert malformed("bad").has_calls


# -- every format, through the same cases -------------------------------------------------------


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_one_call(parser: str) -> None:
    assert parse_tool_calls(RENDER[parser]([SEARCH]), parser) == calls(SEARCH)


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_two_calls_are_both_returned_in_order(parser: str) -> None:
    assert parse_tool_calls(RENDER[parser]([SEARCH, WEATHER]), parser) == calls(SEARCH, WEATHER)
    assert parse_tool_calls(RENDER[parser]([WEATHER, SEARCH]), parser) == calls(WEATHER, SEARCH)


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
@pytest.mark.parametrize(
    "text", ["The answer is 42.", "", "  \n", "I would call search, but no.<|im_end|>"]
)
def test_plain_text_has_no_calls(parser: str, text: str) -> None:
    assert parse_tool_calls(text, parser) == ParsedAction()


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
@pytest.mark.parametrize(
    "end", ["<|im_end|>", "<|eot_id|>", "</s>", "<|eom_id|>", "<|eot|>", "\n<|eot_id|>\n", " \n"]
)
def test_trailing_end_of_turn_tokens_are_tolerated(parser: str, end: str) -> None:
    text = RENDER[parser]([SEARCH, WEATHER]) + end
    assert parse_tool_calls(text, parser) == calls(SEARCH, WEATHER)


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_a_call_inside_reasoning_is_ignored_and_the_one_after_it_returned(parser: str) -> None:
    render = RENDER[parser]
    text = f"<think>I will call {render([SEARCH])}.</think>\n\n{render([SEARCH])}"
    assert parse_tool_calls(text, parser) == calls(SEARCH)


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_a_drafted_call_in_reasoning_is_not_sent_only_the_real_one(parser: str) -> None:
    render = RENDER[parser]
    text = f"<think>Maybe {render([DRAFT])}? No: the weather.</think>\n{render([WEATHER])}"
    assert parse_tool_calls(text, parser) == calls(WEATHER)


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_a_call_in_an_unclosed_reasoning_block_is_not_a_call(parser: str) -> None:
    text = f"<think>Let me call {RENDER[parser]([SEARCH])} and see"
    assert parse_tool_calls(text, parser) == ParsedAction()


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_a_text_that_starts_in_reasoning_ignores_the_calls_before_the_close(parser: str) -> None:
    render = RENDER[parser]
    text = f"plan {render([SEARCH])} </think> answer"
    assert parse_tool_calls(text, parser, starts_in_reasoning=True) == ParsedAction()
    text = f"plan {render([DRAFT])} </think>\n\n{render([WEATHER])}<|im_end|>"
    assert parse_tool_calls(text, parser, starts_in_reasoning=True) == calls(WEATHER)


@pytest.mark.parametrize(
    ("parser", "expected"),
    [
        ("hermes", calls(DRAFT, SEARCH)),
        ("llama3_json", ParsedAction()),  # does not start with an object
        ("mistral", malformed("the tool call is not valid JSON (Extra data)")),
        ("pythonic", ParsedAction()),  # does not start with a list
    ],
)
def test_reasoning_none_reads_the_whole_text(parser: str, expected: ParsedAction) -> None:
    render = RENDER[parser]
    text = f"<think>{render([DRAFT])}</think>{render([SEARCH])}"
    assert parse_tool_calls(text, parser, reasoning=None) == expected
    assert parse_tool_calls(text, parser) == calls(SEARCH)


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_other_reasoning_delimiters(parser: str) -> None:
    render = RENDER[parser]
    text = f"[THINK]{render([DRAFT])}[/THINK]{render([WEATHER])}"
    assert parse_tool_calls(text, parser, reasoning=("[THINK]", "[/THINK]")) == calls(WEATHER)


# -- hermes ------------------------------------------------------------------------------------


def test_hermes_blocks_anywhere_in_the_text() -> None:
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "search", "arguments": {"q": "cats", "limit": 3}}\n</tool_call>'
        ' and then <tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
        " done<|im_end|>"
    )
    assert parse_tool_calls(text) == calls(SEARCH, WEATHER)


def test_hermes_arguments_as_a_json_string_are_decoded_and_may_be_absent() -> None:
    text = (
        '<tool_call>{"name": "weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>'
        '<tool_call>{"name": "now"}</tool_call>'
    )
    assert parse_tool_calls(text, "hermes") == calls(WEATHER, ToolCall("now", {}))


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('<tool_call>{"name": "search", "arguments": {"q": 1', "a <tool_call> block is not closed"),
        ("<tool_call>not json</tool_call>", "the tool call is not valid JSON (Expecting value)"),
        (
            '<tool_call>{"name": "a"} {"name": "b"}</tool_call>',
            "the tool call is not valid JSON (Extra data)",
        ),
        ('<tool_call>{"arguments": {}}</tool_call>', 'the tool call needs a string "name"'),
        ('<tool_call>{"name": 3}</tool_call>', 'the tool call needs a string "name"'),
        ('<tool_call>["search"]</tool_call>', 'the tool call needs a string "name"'),
        (
            '<tool_call>{"name": "search", "arguments": [1]}</tool_call>',
            'the tool call\'s "arguments" must be an object',
        ),
        (
            '<tool_call>{"name": "search", "arguments": "q=cats"}</tool_call>',
            'the tool call\'s "arguments" must be an object',
        ),
    ],
)
def test_hermes_malformed(text: str, error: str) -> None:
    assert parse_tool_calls(text, "hermes") == malformed(error)


def test_hermes_one_malformed_call_makes_the_action_malformed_keeping_the_calls_before() -> None:
    text = _hermes([SEARCH]) + "<tool_call>{oops}</tool_call>" + _hermes([WEATHER])
    error = "the tool call is not valid JSON (Expecting property name enclosed in double quotes)"
    assert parse_tool_calls(text, "hermes") == malformed(error, SEARCH)


# -- llama3_json -------------------------------------------------------------------------------


def test_llama3_json_after_the_python_tag_and_with_arguments_instead_of_parameters() -> None:
    text = '<|python_tag|>{"name": "search", "parameters": {"q": "cats", "limit": 3}}<|eom_id|>'
    assert parse_tool_calls(text, "llama3_json") == calls(SEARCH)
    text = '{"name": "weather", "arguments": {"city": "Paris"}}<|eot_id|>'
    assert parse_tool_calls(text, "llama3_json") == calls(WEATHER)


def test_llama3_json_calls_separated_by_semicolons_even_inside_strings() -> None:
    text = (
        '<|python_tag|>{"name": "search", "parameters": {"q": "a;b", "limit": 3}};'
        '{"name": "weather", "parameters": {"city": "Paris"}};<|eot_id|>'
    )
    assert parse_tool_calls(text, "llama3_json") == calls(
        ToolCall("search", {"q": "a;b", "limit": 3}), WEATHER
    )


def test_llama3_json_text_that_does_not_start_with_an_object_is_an_answer() -> None:
    text = 'Here you go: {"name": "search", "parameters": {}}'
    assert parse_tool_calls(text, "llama3_json") == ParsedAction()


@pytest.mark.parametrize(
    ("text", "error", "before"),
    [
        (
            '{"name": "search", "parameters": {"q"',
            "the tool call is not valid JSON (Expecting ':' delimiter)",
            (),
        ),
        ("<|python_tag|>", "the tool call is not valid JSON (Expecting value)", ()),
        (
            '<|python_tag|>brave_search.call(query="cats")',
            "the tool call is not valid JSON (Expecting value)",
            (),
        ),
        ('{"parameters": {}}', 'the tool call needs a string "name"', ()),
        (
            '{"name": "search", "parameters": 3}',
            'the tool call\'s "parameters" must be an object',
            (),
        ),
        (
            '{"name": "weather", "parameters": {"city": "Paris"}} and more',
            'the tool calls must be separated by ";"',
            (WEATHER,),
        ),
        (
            '{"name": "weather", "parameters": {"city": "Paris"}}; {"name": 1}',
            'the tool call needs a string "name"',
            (WEATHER,),
        ),
    ],
)
def test_llama3_json_malformed(text: str, error: str, before: tuple[ToolCall, ...]) -> None:
    assert parse_tool_calls(text, "llama3_json") == malformed(error, *before)


# -- mistral -----------------------------------------------------------------------------------


def test_mistral_v3_content_before_the_marker_and_a_single_object() -> None:
    text = (
        'Sure.[TOOL_CALLS] [{"name": "search", "arguments": {"q": "cats", "limit": 3}}, '
        '{"name": "weather", "arguments": {"city": "Paris"}}]</s>'
    )
    assert parse_tool_calls(text, "mistral") == calls(SEARCH, WEATHER)
    text = '[TOOL_CALLS]{"name": "weather", "arguments": {"city": "Paris"}}'
    assert parse_tool_calls(text, "mistral") == calls(WEATHER)


def test_mistral_v11_name_args_after_each_marker() -> None:
    text = (
        'Let me check.[TOOL_CALLS]search[ARGS]{"q": "cats", "limit": 3}'
        '[TOOL_CALLS]weather[ARGS]{"city": "Paris"}</s>'
    )
    assert parse_tool_calls(text, "mistral") == calls(SEARCH, WEATHER)
    text = '[TOOL_CALLS]weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}'
    assert parse_tool_calls(text, "mistral") == calls(WEATHER)


def test_mistral_without_a_marker_has_no_calls() -> None:
    text = '[{"name": "search", "arguments": {}}]'
    assert parse_tool_calls(text, "mistral") == ParsedAction()


@pytest.mark.parametrize(
    ("text", "error", "before"),
    [
        ("[TOOL_CALLS]", "a [TOOL_CALLS] marker is followed by no call", ()),
        (
            "[TOOL_CALLS][{]",
            "the tool call is not valid JSON (Expecting property name enclosed in double quotes)",
            (),
        ),
        ('[TOOL_CALLS][{"arguments": {}}]', 'the tool call needs a string "name"', ()),
        (
            '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Paris"}}, '
            '{"name": "search", "arguments": 1}]',
            'the tool call\'s "arguments" must be an object',
            (WEATHER,),
        ),
        ('[TOOL_CALLS]search{"q": "cats"}', "a [TOOL_CALLS] call has no [ARGS]", ()),
        ('[TOOL_CALLS][ARGS]{"q": "cats"}', "a [TOOL_CALLS] call needs a name before [ARGS]", ()),
        (
            "[TOOL_CALLS]search[ARGS]{",
            "the tool call is not valid JSON (Expecting property name enclosed in double quotes)",
            (),
        ),
        ("[TOOL_CALLS]search[ARGS][1]", "the arguments of search must be a JSON object", ()),
        (
            '[TOOL_CALLS]weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[ARGS]{"q": "cats"} ok',
            "the tool call is not valid JSON (Extra data)",
            (WEATHER,),
        ),
    ],
)
def test_mistral_malformed(text: str, error: str, before: tuple[ToolCall, ...]) -> None:
    assert parse_tool_calls(text, "mistral") == malformed(error, *before)


# -- pythonic ----------------------------------------------------------------------------------


def test_pythonic_literals_json_names_and_the_llama4_wrapper() -> None:
    text = (
        '[search(q="cats", limit=3), '
        "configure(flags=[1, -2.5, 'x'], opts={'a': (1, 2)}, on=true, off=False, none=null)]"
    )
    assert parse_tool_calls(text, "pythonic") == calls(
        SEARCH,
        ToolCall(
            "configure",
            {
                "flags": [1, -2.5, "x"],
                "opts": {"a": (1, 2)},
                "on": True,
                "off": False,
                "none": None,
            },
        ),
    )
    text = '<|python_start|>[weather(city="Paris"), now()]<|python_end|><|eot|>'
    assert parse_tool_calls(text, "pythonic") == calls(WEATHER, ToolCall("now", {}))


def test_pythonic_empty_list_and_text_not_starting_with_a_bracket_have_no_calls() -> None:
    assert parse_tool_calls("[]", "pythonic") == ParsedAction()
    text = 'I would call [search(q="cats")].'
    assert parse_tool_calls(text, "pythonic") == ParsedAction()


@pytest.mark.parametrize(
    ("text", "error", "before"),
    [
        (
            '[search("cats")]',
            "the call to search has a positional argument (only keyword arguments are allowed)",
            (),
        ),
        (
            "[search(*qs)]",
            "the call to search has a positional argument (only keyword arguments are allowed)",
            (),
        ),
        (
            "[search(**kw)]",
            "the call to search unpacks ** (only keyword arguments are allowed)",
            (),
        ),
        (
            '[weather(city="Paris"), search(q=input())]',
            "the argument q of search is not a literal (input())",
            (WEATHER,),
        ),
        ("[search(q=cats)]", "the argument q of search is not a literal (cats)", ()),
        (
            "[search(q=[true, x])]",
            "the argument q of search is not a literal ([true, x])",
            (),
        ),
        ('[search(q="a", q="b")]', "the call to search repeats the argument q", ()),
        ('[search(q="cats"', "the tool calls are not valid Python ('(' was never closed)", ()),
        ('[search(q="cats")] done', "the tool calls are not valid Python (invalid syntax)", ()),
        ("[1, 2]", "the tool calls must be a Python list of calls", ()),
        ('<|python_start|>search(q="cats")', "the tool calls must be a Python list of calls", ()),
        (
            '[os.system(cmd="ls")]',
            "a tool call must name a plain function, not os.system",
            (),
        ),
        ('[f()(q="cats")]', "a tool call must name a plain function, not f()", ()),
    ],
)
def test_pythonic_malformed(text: str, error: str, before: tuple[ToolCall, ...]) -> None:
    assert parse_tool_calls(text, "pythonic") == malformed(error, *before)


def test_pythonic_never_evaluates() -> None:
    touched: list[Any] = []
    text = "[f(x=touched.append(1))]"
    assert parse_tool_calls(text, "pythonic") == malformed(
        "the argument x of f is not a literal (touched.append(1))"
    )
    assert touched == []


# -- strip_reasoning ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "starts_in_reasoning", "expected"),
    [
        ("<think>plan</think>\n\nanswer", False, "\n\nanswer"),
        ("  \n<think>plan</think>answer", False, "answer"),
        ("answer", False, "answer"),
        ("", False, ""),
        ("a <think>x</think>b<think>y</think> c", False, "a b c"),
        ("<think>x</think>a<think>y</think>b", False, "ab"),
        ("<think>never closed", False, ""),
        ("answer <think>never closed", False, "answer "),
        ("plan </think> answer", True, " answer"),
        ("plan </think> answer", False, "plan </think> answer"),
        ("plan without a close", True, ""),
        ("plan </think>a<think>b</think>c</think>d", True, "ac</think>d"),
        ("<think>a</think>b", True, "b"),
    ],
)
def test_strip_reasoning(text: str, starts_in_reasoning: bool, expected: str) -> None:
    assert strip_reasoning(text, starts_in_reasoning=starts_in_reasoning) == expected


def test_strip_reasoning_other_delimiters() -> None:
    text = "[THINK]plan[/THINK]answer <think>kept</think>"
    assert strip_reasoning(text, ("[THINK]", "[/THINK]")) == "answer <think>kept</think>"
    with pytest.raises(ValueError, match="must not be empty"):
        strip_reasoning("x", ("", "</think>"))
