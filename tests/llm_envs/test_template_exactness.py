# ruff: noqa: RUF001 (DeepSeek's end-of-turn token is spelt with fullwidth bars, on purpose)
"""Token exactness over a corpus of real chat templates, on the built-in tokenizer and on two
real SentencePiece tokenizers (``mistral-common``'s v1 and v3 models).

For every prompt the harness builds, the reference is derived here, independently of the
harness: the template renders the conversation with a marker token in place of each assistant
turn's content, the whole text is tokenized in one call, and the ids the policy sampled are
put in place of each marker. When a completion ends with the template's end-of-turn token,
the template's close of that turn up to that token is the completion's own (it is not
rendered twice); spaces the template puts before an assistant's content (Llama-2's
``' ' + content``) are the completion's own too. Where the template is not prefix-stable for
the conversation's shape, each turn is a new sample whose prompt must equal
``apply_chat_template`` of what the policy saw.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from echo_envs import ScriptedEnv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from real_tokenizers import load_mistral_tokenizer
from template_corpus import CASES, TemplateCase, get_case, with_template

from agile_llmenvs.llm_envs import RolloutHarness, apply_chat_template
from agile_llmenvs.llm_envs.framing import ChatFramer

pytest.importorskip("sentencepiece")
pytest.importorskip("mistral_common")

#: The token each family's model samples to end its turn.
END_OF_TURN = {
    "chatml_qwen25": "<|im_end|>",
    "qwen3": "<|im_end|>",
    "llama2": "</s>",
    "mistral_v01": "</s>",
    "mistral_v03": "</s>",
    "llama31": "<|eot_id|>",
    "gemma": "<end_of_turn>",
    "deepseek_r1": "<｜end▁of▁sentence｜>",
    "phi3": "<|end|>",
}
#: Whether each template is prefix-stable without and with a system message, read off its
#: format: Qwen3 drops earlier reasoning, DeepSeek-R1's generation prompt opens a <think> the
#: rendering of the turn drops, Mistral v0.3 moves the system prompt into the last user turn;
#: Mistral v0.1 and Gemma have no system role.
APPENDABLE = {
    "chatml_qwen25": (True, True),
    "qwen3": (False, False),
    "llama2": (True, True),
    "mistral_v01": (True, None),
    "mistral_v03": (True, False),
    "llama31": (True, True),
    "gemma": (True, None),
    "deepseek_r1": (False, False),
    "phi3": (True, True),
}
TOKENIZERS = ("tiny", "mistral_v1", "mistral_v3")
MARK = "<|sampled_here|>"  # a special token of the reference tokenizer only
WORDS = [
    "the",
    "digit",
    "7",
    "board:",
    "(3, 4)",
    "Right!",
    "naïve",
    "é",
    "=>",
    "\n",
    " ",
    "  two spaces",
    "score=1.5\n",
    "[INST]",
    "line\n\nbreak",
]
_TINY_DIR: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def _tiny(tiny_model_dir: Path) -> None:
    _TINY_DIR[:] = [tiny_model_dir]


def _loader(name: str) -> Callable[[], Any]:
    if name == "tiny":
        from transformers import AutoTokenizer

        return lambda: AutoTokenizer.from_pretrained(_TINY_DIR[0])
    return lambda: load_mistral_tokenizer(name)


@cache
def tokenizer_for(tokenizer_name: str, case_name: str) -> Any:
    return with_template(_loader(tokenizer_name), get_case(case_name))


@cache
def _reference_tokenizer(tokenizer_name: str, case_name: str) -> Any:
    tokenizer = copy.deepcopy(tokenizer_for(tokenizer_name, case_name))
    tokenizer.add_special_tokens({"additional_special_tokens": [MARK]})
    return tokenizer


def _sampleable_ids(tokenizer: Any) -> list[int]:
    """Ids a policy could sample that are no special or added token."""
    added = set(tokenizer.added_tokens_decoder)
    return [i for i in range(len(tokenizer)) if i not in added]


def reference_ids(
    tokenizer_name: str,
    case: TemplateCase,
    messages: Sequence[dict[str, Any]],
    completions: Sequence[list[int]],
    *,
    tail: bool = True,
) -> list[int]:
    """The template's rendering with the sampled ids in place of each assistant content
    (``tail=False``: up to the last completion only)."""
    reference = _reference_tokenizer(tokenizer_name, case.name)
    eot = END_OF_TURN[case.name]
    eot_id = reference.convert_tokens_to_ids(eot)
    marked, k = [], 0
    for message in messages:
        if message["role"] == "assistant":
            marked.append({"role": "assistant", "content": f"⟦{k}⟧"})
            k += 1
        else:
            marked.append(dict(message))
    text = reference.apply_chat_template(marked, tokenize=False, add_generation_prompt=True)
    pieces = []
    for index, completion in enumerate(completions):
        head, text = text.split(f"⟦{index}⟧")
        pieces.append(head.rstrip(" "))  # the template's spaces before content are sampled
        if completion[-1:] == [eot_id]:  # the completion closed its turn itself
            text = text[text.index(eot) + len(eot) :]
        pieces.append(MARK)
    pieces.append(text if tail else "")
    ids = reference.encode("".join(pieces), add_special_tokens=False)
    mark_id = reference.convert_tokens_to_ids(MARK)
    out: list[int] = []
    sampled = iter(completions)
    for token in ids:
        out.extend(next(sampled) if token == mark_id else [token])
    return out


def check_episode(
    tokenizer_name: str,
    case: TemplateCase,
    observations: Sequence[str],
    completions: Sequence[list[int]],
    system: str | None,
    harness_type: type[RolloutHarness] = RolloutHarness,
) -> None:
    """Play the episode; assert every prompt against the template (see the module doc)."""
    tokenizer = tokenizer_for(tokenizer_name, case.name)
    harness = harness_type.local(
        ScriptedEnv(list(observations)), tokenizer, len(completions), system_prompt=system
    )
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": observations[0]})
    assert harness.reset() == apply_chat_template(tokenizer, messages)
    appendable = APPENDABLE[case.name][bool(system)]
    assert ChatFramer(tokenizer).appendable(system=bool(system)) is appendable
    for turn, completion in enumerate(completions):
        result = harness.step(completion)
        text = tokenizer.decode(completion, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
        if result.done:
            break
        messages.append({"role": "user", "content": observations[turn + 1]})
        if appendable:
            assert not result.new_sample
            expected = reference_ids(tokenizer_name, case, messages, completions[: turn + 1])
            assert harness.context_ids == expected
        else:
            assert result.new_sample
            assert result.prompt_ids == apply_chat_template(tokenizer, messages)
            assert harness.context_ids == result.prompt_ids
    last = harness.get_episode_data().samples[-1].token_ids
    if appendable:  # the whole episode is one sample: the template's, with the sampled ids
        played = completions[: turn + 1]
        assert list(last) == reference_ids(tokenizer_name, case, messages, played, tail=False)
    else:
        assert list(last) == [*apply_chat_template(tokenizer, messages[:-1]), *completion]


text = st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map(" ".join)


@st.composite
def episodes(draw: Any, tokenizer_name: str, case: TemplateCase) -> tuple[Any, ...]:
    tokenizer = tokenizer_for(tokenizer_name, case.name)
    ids = _sampleable_ids(tokenizer)
    eot_id = tokenizer.convert_tokens_to_ids(END_OF_TURN[case.name])
    turns = draw(st.integers(1, 4))
    observations = draw(st.lists(text, min_size=turns + 1, max_size=turns + 1))
    completions = []
    for _ in range(turns):
        if draw(st.booleans()):  # random ids: partial UTF-8, odd merges, no canonical form
            body = draw(st.lists(st.sampled_from(ids), min_size=1, max_size=10))
        else:
            body = tokenizer.encode(draw(text), add_special_tokens=False)
        end = draw(st.sampled_from(["eot", "none", "eot"]))  # no EOS: cut by max tokens
        completions.append([*body, eot_id] if end == "eot" else body)
    system = draw(st.sampled_from([None, "Be brief."])) if case.system else None
    return observations, completions, system


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_prompt_equals_the_templates_rendering(
    tokenizer_name: str, case: TemplateCase, data: Any
) -> None:
    observations, completions, system = data.draw(episodes(tokenizer_name, case))
    check_episode(tokenizer_name, case, observations, completions, system)


# -- the property test can fail: each mutation of the harness breaks it ---------------------


def _ids(tokenizer: Any, pieces: Sequence[str]) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(piece) for piece in pieces]


class _ReencodingHarness(RolloutHarness):
    """Rebuilds each completion from its text: not the ids the policy sampled."""

    def step(self, completion_ids: Sequence[int], sampling_logps: Any = None) -> Any:
        text = self.tokenizer.decode(list(completion_ids))
        return super().step(self.tokenizer.encode(text, add_special_tokens=False))


def test_re_encoding_a_completion_fails_the_check() -> None:
    case = get_case("chatml_qwen25")
    tokenizer = tokenizer_for("tiny", case.name)
    spelled = [*_ids(tokenizer, ["t", "h", "e"]), tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert tokenizer.encode("the", add_special_tokens=False) != spelled[:3]  # not canonical
    check_episode("tiny", case, ["a", "b", "c"], [spelled] * 2, None)
    with pytest.raises(AssertionError):
        check_episode("tiny", case, ["a", "b", "c"], [spelled] * 2, None, _ReencodingHarness)


def test_dropping_the_end_of_turn_overlap_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    case = get_case("llama2")
    tokenizer = tokenizer_for("mistral_v1", case.name)
    completion = [*tokenizer.encode("four", add_special_tokens=False), tokenizer.eos_token_id]
    check_episode("mistral_v1", case, ["a", "b", "c"], [completion] * 2, None)
    monkeypatch.setattr(ChatFramer, "_skip", lambda self, completion, frame: 0)
    with pytest.raises(AssertionError):
        check_episode("mistral_v1", case, ["a", "b", "c"], [completion] * 2, None)


def test_probing_without_the_system_message_fails_the_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    case = get_case("mistral_v03")
    tokenizer = tokenizer_for("mistral_v3", case.name)
    completion = [*tokenizer.encode("four", add_special_tokens=False), tokenizer.eos_token_id]
    check_episode("mistral_v3", case, ["a", "b", "c"], [completion] * 2, "Be brief.")
    frame = ChatFramer.frame
    monkeypatch.setattr(
        ChatFramer, "frame", lambda self, role="user", *, system=False: frame(self, role)
    )
    with pytest.raises(AssertionError):
        check_episode("mistral_v3", case, ["a", "b", "c"], [completion] * 2, "Be brief.")
