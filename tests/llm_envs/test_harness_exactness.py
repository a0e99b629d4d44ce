"""Token exactness, as a property over random multi-turn episodes with the tiny tokenizer."""

from __future__ import annotations

from typing import Any

from echo_envs import ScriptedEnv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agile_llmenvs.llm_envs import RolloutHarness, StopReason, apply_chat_template

WORDS = [
    "say",
    "the",
    "digit",
    "7",
    "42",
    "board:",
    "x",
    "o",
    "move",
    "left",
    "Right!",
    "Wrong.",
    "(3, 4)",
    "score=1.5",
    "done?",
    "é",
    "naïve",
    "=>",
    "a,b",
]
EOS = 2  # <|im_end|>
SPECIAL = {0, 1, 2}

text = st.lists(st.sampled_from(WORDS), min_size=1, max_size=8).map(" ".join)
# A completion is random ids (not how the tokenizer would encode anything: re-encoding its
# decoded text gives other ids) or a canonical encoding, either optionally ending with <|im_end|>.
completion = st.tuples(
    st.one_of(
        st.lists(st.integers(3, 449), min_size=1, max_size=12).map(lambda ids: ("ids", ids)),
        text.map(lambda t: ("text", t)),
    ),
    st.booleans(),
)
episodes = st.integers(1, 5).flatmap(
    lambda turns: st.tuples(
        st.lists(text, min_size=turns + 1, max_size=turns + 1),
        st.lists(completion, min_size=turns, max_size=turns),
    )
)


def _ids(tokenizer: Any, spec: tuple[tuple[str, Any], bool]) -> list[int]:
    (kind, value), eos = spec
    ids = list(value) if kind == "ids" else tokenizer.encode(value, add_special_tokens=False)
    return [*ids, EOS] if eos else ids


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(episode=episodes)
def test_ids_are_prompt_plus_sampled_plus_frames_and_the_mask_marks_the_sampled(
    tokenizer: Any, episode: tuple[list[str], list[Any]]
) -> None:
    observations, specs = episode
    completions = [_ids(tokenizer, spec) for spec in specs]
    harness = RolloutHarness.local(ScriptedEnv(observations), tokenizer, max_turns=len(specs))
    prompt = harness.reset()
    assert prompt == apply_chat_template(tokenizer, [{"role": "user", "content": observations[0]}])
    expected = list(prompt)
    for turn, ids in enumerate(completions):
        logps = [-0.01 * (turn + 1) * (i + 1) for i in range(len(ids))]
        result = harness.step(ids, logps)
        expected += ids
        if turn < len(completions) - 1:
            # the frame, derived independently: the template's text for this turn, tokenized
            # whole by the tokenizer itself, without a second <|im_end|>
            frame_text = (
                f"<|im_end|>\n<|im_start|>user\n{observations[turn + 1]}<|im_end|>\n"
                "<|im_start|>assistant\n"
            )
            frame = tokenizer.encode(frame_text, add_special_tokens=False)
            if ids[-1] == EOS:
                frame = frame[1:]
            assert result.prompt_ids == frame
            expected += frame
        else:
            assert result.done
    data = harness.get_episode_data()
    assert data.stop_reason is StopReason.TERMINATED
    assert list(data.token_ids) == expected
    assert len(data.action_mask) == len(data.turn_ids) == len(data.token_ids) - 1
    sampled = [data.token_ids[i + 1] for i, m in enumerate(data.action_mask) if m]
    assert sampled == [token for ids in completions for token in ids]  # verbatim, never re-encoded
    turns = [t for t, m in zip(data.turn_ids, data.action_mask, strict=True) if m]
    assert turns == [turn for turn, ids in enumerate(completions) for _ in ids]
    assert all(t == -1 for t, m in zip(data.turn_ids, data.action_mask, strict=True) if not m)
    assert data.sampling_logps == tuple(
        -0.01 * (turn + 1) * (i + 1)
        for turn, ids in enumerate(completions)
        for i in range(len(ids))
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(observations=st.lists(text, min_size=2, max_size=5), answers=st.data())
def test_canonical_episodes_equal_the_templates_rendering_of_the_messages(
    tokenizer: Any, observations: list[str], answers: st.DataObject
) -> None:
    turns = len(observations) - 1
    replies = [answers.draw(text) for _ in range(turns)]
    harness = RolloutHarness.local(
        ScriptedEnv(observations), tokenizer, max_turns=turns, system_prompt="You play a game."
    )
    harness.reset()
    for reply in replies:
        harness.step([*tokenizer.encode(reply, add_special_tokens=False), EOS])
    messages = [{"role": "system", "content": "You play a game."}]
    for observation, reply in zip(observations, replies, strict=False):
        messages += [
            {"role": "user", "content": observation},
            {"role": "assistant", "content": reply},
        ]
    rendered = apply_chat_template(tokenizer, messages, add_generation_prompt=False)
    ids = list(harness.get_episode_data().token_ids)
    # the template closes the last assistant turn with "<|im_end|>\n"; the row ends at <|im_end|>
    assert rendered == [*ids, *tokenizer.encode("\n", add_special_tokens=False)]
