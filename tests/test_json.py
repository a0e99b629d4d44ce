"""The package's JSON reads and writes what Python's ``json`` would, fast paths or not."""

from __future__ import annotations

import enum
import json
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agile_llmenvs import _json
from agile_llmenvs.transport.protocol import WireError, text_observation_frame

_STANDARD_OUT = json.JSONEncoder(allow_nan=False, separators=(",", ":")).encode


@pytest.mark.parametrize(
    "text",
    [
        '{"type":"step","data":{"message":"hi"}}',
        '{"type": "step", "data": {"message": "h\\u00e9 \\ud800"}}',  # a lone surrogate escape
        ' {"a": 1} ',  # whitespace around: decode's path
        '{"n": 123456789012345678901234567890, "m": -9223372036854775809}',  # past 64 bits
        '{"big": 1e400, "small": 1e-400, "neg": -0.0}',
        '{"a": 1, "a": 2}',
        "[1, 2]",
        '"text"',
    ],
)
def test_loads_reads_what_the_standard_decoder_reads(text: str) -> None:
    value = _json.loads(text)
    assert value == json.loads(text)
    assert repr(value) == repr(json.loads(text))  # the same types: 30 digits stay an int
    assert _json.loads(text.encode()) == value


@pytest.mark.parametrize(
    ("text", "error", "message"),
    [
        ('{"reward": NaN}', ValueError, "NaN is not JSON"),
        ('{"reward": -Infinity}', ValueError, "-Infinity is not JSON"),
        ('{"a": 1}x', json.JSONDecodeError, "Extra data: line 1 column 9 (char 8)"),
        ('{"a": 1}}', json.JSONDecodeError, "Extra data: line 1 column 9 (char 8)"),
        ('{"a": }', json.JSONDecodeError, "Expecting value: line 1 column 7 (char 6)"),
        ('{"a": "\x01"}', json.JSONDecodeError, "Invalid control character at"),
        ("", json.JSONDecodeError, "Expecting value: line 1 column 1 (char 0)"),
        ("[" * 200_000, ValueError, "nested deeper than the parser can follow"),
        ('{"a":' * 100_000 + "1" + "}" * 100_000, ValueError, "nested deeper than the parser"),
    ],
)
def test_loads_refuses_what_the_strict_decoder_refuses_with_its_message(
    text: str, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as caught:
        _json.loads(text)
    assert str(caught.value).startswith(message)


def test_loads_refuses_bytes_that_are_not_utf8() -> None:
    with pytest.raises(UnicodeDecodeError):
        _json.loads(b'{"a": "\xff"}')


class Colour(enum.Enum):
    RED = "red"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"type": "step", "data": {"message": "hé"}}, True),
        ({"a": [1, 2.5, None, True, "x", (3,)]}, True),
        ({"a": 2**64, "b": -(2**70)}, True),
        ({"a": float("nan")}, False),
        ({"a": [float("inf")]}, False),
        ({1: "a"}, False),  # json writes the key as "1"
        ({"a": Colour.RED}, False),  # msgspec writes an enum's value; json refuses it
        ({"a": uuid.UUID(int=0)}, False),
        ({"a": {"b": {"c": set()}}}, False),
    ],
)
def test_plain_holds_only_json_values_of_their_exact_type(value: Any, expected: bool) -> None:
    assert _json.plain(value) is expected


def test_dumps_writes_a_plain_value_compact_with_non_ascii_kept() -> None:
    text = _json.dumps({"type": "step", "data": {"message": "hé", "n": [1, 2.5]}}, str)
    assert text == '{"type":"step","data":{"message":"hé","n":[1,2.5]}}'


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ({1: "a"}, '{"1":"a"}'),
        ({"a": "\ud800"}, '{"a":"\\ud800"}'),  # plain, but not UTF-8: msgspec refuses it
    ],
)
def test_dumps_gives_anything_else_to_the_standard_encoder(value: Any, text: str) -> None:
    assert _json.dumps(value, _STANDARD_OUT) == text


@pytest.mark.parametrize("value", [{"a": float("nan")}, {"a": Colour.RED}])
def test_dumps_lets_the_standard_encoder_refuse(value: Any) -> None:
    with pytest.raises((ValueError, TypeError)) as caught:
        _json.dumps(value, _STANDARD_OUT)
    with pytest.raises(type(caught.value)):
        _STANDARD_OUT(value)


def test_without_msgspec_every_value_takes_the_standard_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_json, "_ENCODE", None)
    monkeypatch.setattr(_json, "_DECODE", None)
    assert _json.dumps({"message": "hé"}, json.dumps) == '{"message": "h\\u00e9"}'
    with pytest.raises(ValueError, match=r"^NaN is not JSON$"):
        _json.loads('{"a": NaN}')
    assert repr(_json.loads('{"n": 123456789012345678901234567890}')) == (
        "{'n': 123456789012345678901234567890}"
    )


def test_a_text_reply_checked_without_a_walk_reads_back_as_its_fields() -> None:
    frame = text_observation_frame(
        prompt="hé",
        reward=0.5,
        done=False,
        truncated=True,
        question=None,
        answer="4",
        metadata={"seen": "x", "score": 0.25},
    )
    assert frame == (
        '{"type":"observation","data":{"observation":{"metadata":{"seen":"x","score":0.25},'
        '"prompt":"hé","truncated":true,"question":null,"answer":"4"},"reward":0.5,'
        '"done":false,"metadata":{"seen":"x","score":0.25}}}'
    )


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"reward": float("nan")}, "reward is NaN"),
        ({"metadata": {"score": float("-inf")}}, "observation.metadata.score is -Infinity"),
    ],
)
def test_a_text_reply_with_a_non_finite_number_is_refused_naming_it(
    fields: dict[str, Any], name: str
) -> None:
    base: dict[str, Any] = {
        "prompt": "p",
        "reward": 1.0,
        "done": False,
        "truncated": False,
        "question": None,
        "answer": None,
        "metadata": {},
    }
    with pytest.raises(WireError, match=f"the env's {name}"):
        text_observation_frame(**{**base, **fields})


_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(value=_JSON_VALUES, spaced=st.booleans())
def test_any_json_text_reads_as_the_standard_decoder_reads_it(value: Any, spaced: bool) -> None:
    text = json.dumps(value, separators=(", ", ": ") if spaced else (",", ":"))
    assert repr(_json.loads(text)) == repr(json.loads(text))
    assert repr(_json.loads(_json.dumps(value, str))) == repr(value)


@settings(max_examples=400, deadline=None)
@given(
    digits=st.from_regex(
        r"-?(0|[1-9][0-9]{0,25})(\.[0-9]{1,25})?([eE][-+]?[0-9]{1,3})?", fullmatch=True
    )
)
def test_every_number_reads_as_the_standard_decoder_reads_it(digits: str) -> None:
    text = f'{{"n": {digits}}}'
    assert repr(_json.loads(text)) == repr(json.loads(text))


# -- the generation servers' bodies and replies -----------------------------------------------


def test_dumps_bytes_writes_a_completion_body_compact() -> None:
    body = {"model": "tiny", "prompt": [3, 1, 2], "temperature": 0.5, "stop": ["é"], "seed": 7}
    assert _json.dumps_bytes(body, ids="prompt") == (
        b'{"model":"tiny","prompt":[3,1,2],"temperature":0.5,"stop":["\xc3\xa9"],"seed":7}'
    )


@pytest.mark.parametrize(
    ("body", "raw"),
    [
        # a non-finite float outside the ids: written as json.dumps writes it, not as null
        ({"temperature": float("nan"), "prompt": [1]}, b'{"temperature":NaN,"prompt":[1]}'),
        ({"top_p": float("-inf")}, b'{"top_p":-Infinity}'),
        ({"model": "\ud800"}, b'{"model":"\\ud800"}'),  # a lone surrogate: escaped
        ({"prompt": [2**70]}, b'{"prompt":[1180591620717411303424]}'),  # past 64 bits
    ],
)
def test_dumps_bytes_writes_what_json_writes_off_the_fast_path(
    body: dict[str, Any], raw: bytes
) -> None:
    assert _json.dumps_bytes(body, ids="prompt") == raw


def test_dumps_bytes_refuses_an_id_json_cannot_write_as_json_refuses_it() -> None:
    np = pytest.importorskip("numpy")
    body = {"prompt": [1, np.int64(2)]}
    with pytest.raises(TypeError) as ours:
        _json.dumps_bytes(body, ids="prompt")
    with pytest.raises(TypeError) as theirs:
        json.dumps(body)
    assert str(ours.value) == str(theirs.value) == "Object of type int64 is not JSON serializable"


def test_dumps_bytes_walks_every_field_but_the_ids() -> None:
    # an enum elsewhere in the body is not plain: the standard encoder refuses it, as before
    with pytest.raises(TypeError, match="Object of type Colour is not JSON serializable"):
        _json.dumps_bytes({"prompt": [1], "colour": Colour.RED}, ids="prompt")


@pytest.mark.parametrize(
    "raw",
    [
        b'{"choices":[{"logprobs":{"tokens":["token_id:5"],"token_logprobs":[-0.25]}}]}',
        b'{"token_logprobs": [NaN, -Infinity, Infinity]}',  # Python servers write these
        b'{"n": 123456789012345678901234567890, "x": 1e400}',
        b'\xef\xbb\xbf{"bom": 1}',  # json.loads reads bytes with a UTF-8 BOM
        '{"utf16": "é"}'.encode("utf-16"),  # json.loads detects the UTF it is in
    ],
)
def test_loads_lenient_reads_what_json_loads_reads(raw: bytes) -> None:
    assert repr(_json.loads_lenient(raw)) == repr(json.loads(raw))


def test_loads_lenient_refuses_what_json_loads_refuses() -> None:
    with pytest.raises(json.JSONDecodeError, match=r"^Expecting value: line 1 column 7"):
        _json.loads_lenient(b'{"a": }')


def test_without_msgspec_bodies_and_replies_take_the_standard_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_json, "_ENCODE", None)
    monkeypatch.setattr(_json, "_DECODE", None)
    assert _json.dumps_bytes({"m": "é", "prompt": [1]}, ids="prompt") == (
        b'{"m":"\\u00e9","prompt":[1]}'
    )
    assert repr(_json.loads_lenient(b'{"a": NaN}')) == "{'a': nan}"


@settings(max_examples=300, deadline=None)
@given(
    rest=st.dictionaries(st.text(max_size=6).filter(lambda k: k != "prompt"), _JSON_VALUES),
    ids=st.lists(st.integers(min_value=0, max_value=2**40), max_size=50),
)
def test_any_body_reads_back_as_the_value_json_writes(rest: dict[str, Any], ids: list[int]) -> None:
    body = {**rest, "prompt": ids}
    raw = _json.dumps_bytes(body, ids="prompt")
    assert repr(json.loads(raw)) == repr(json.loads(json.dumps(body)))
    assert repr(_json.loads_lenient(raw)) == repr(json.loads(raw))
