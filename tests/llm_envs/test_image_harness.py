"""Image observations through the harness: ids, masks and placeholders are the processor's own
rendering of the same conversation, images stay aligned across a context restart, and bad
images fail their episode only."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from image_envs import PictureEnv, square

from agile_llmenvs.llm_envs import RolloutCollector, RolloutHarness, StopReason
from agile_llmenvs.tiny_vlm import load_processor
from agile_llmenvs.transport.images import ImageObservationError, encode_image

RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


@pytest.fixture(scope="module")
def processor(tiny_vlm_dir: Path) -> Any:
    return load_processor(tiny_vlm_dir)


def _processor_ids(processor: Any, messages: list[dict[str, Any]], images: list[Any]) -> list[int]:
    """The processor's own rendering: its template's text, tokenized with the images."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = processor(text=[text], images=images or None, add_special_tokens=False)
    return list(out["input_ids"][0])


def _user(images: list[Any], text: str) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def _completion(processor: Any, text: str) -> list[int]:
    tokenizer = processor.tokenizer
    return [
        *tokenizer.encode(text, add_special_tokens=False),
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
    ]


def _harness(processor: Any, env: Any, **settings: Any) -> RolloutHarness:
    return RolloutHarness.local(
        env,
        processor.tokenizer,
        settings.pop("max_turns", 3),
        vision_processor=processor,
        **settings,
    )


def test_first_prompt_is_the_processors_rendering(processor: Any) -> None:
    image = square(RED)
    harness = _harness(processor, PictureEnv([[image]], turns=1), instruction="Name the colour.")
    ids = harness.reset(seed=0)
    expected = _processor_ids(processor, [_user([image], "Name the colour.\n\nlook 0")], [image])
    assert ids == expected
    # a 56 x 56 image is 4 x 4 patches of 14, merged 2 x 2: four placeholder tokens
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ids.count(pad) == 4
    shown = harness.context_images
    assert shown is not None
    assert shown.images == (image,)
    assert shown.placeholder_tokens == 4
    pixels = processor.image_processor(images=[image], return_tensors="pt")
    assert torch.equal(shown.tensors["pixel_values"], pixels["pixel_values"])
    assert shown.tensors["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_multi_turn_sample_equals_the_whole_conversation_rendered(processor: Any) -> None:
    # three sizes: 4 x 4 patches (4 tokens), 2 x 4 (2 tokens), 4 x 2 (2 tokens)
    first, second, third = square(RED), square(GREEN, 56, 28), square(BLUE, 28, 56)
    env = PictureEnv([[first], [second, third], []], turns=3)
    harness = _harness(processor, env)
    harness.reset()
    actions = ["red", "green blue"]
    completions = [_completion(processor, a) for a in actions]
    harness.step(completions[0])
    result = harness.step(completions[1])
    assert not result.done
    assert not result.new_sample
    messages = [
        _user([first], "look 0"),
        {"role": "assistant", "content": actions[0]},
        _user([second, third], "look 1"),
        {"role": "assistant", "content": actions[1]},
        {"role": "user", "content": "look 2"},
    ]
    assert harness.context_ids == _processor_ids(processor, messages, [first, second, third])
    harness.step(_completion(processor, "done"))
    (sample,) = harness.get_episode_data().samples
    ids = list(sample.token_ids)
    # the sampled ids sit where the processor renders each assistant turn, and only they train
    trained = [ids[i + 1] for i, sampled in enumerate(sample.action_mask) if sampled]
    assert trained == [*completions[0], *completions[1], *_completion(processor, "done")]
    assert sample.images is not None
    assert sample.images.images == (first, second, third)
    assert (
        sample.images.placeholder_tokens
        == 4 + 2 + 2
        == ids.count(processor.tokenizer.convert_tokens_to_ids("<|image_pad|>"))
    )
    everything = processor.image_processor(images=[first, second, third], return_tensors="pt")
    assert torch.equal(sample.images.tensors["pixel_values"], everything["pixel_values"])
    assert sample.images.tensors["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 4], [1, 4, 2]]


def test_segment_max_images_restarts_with_the_latest_images(processor: Any) -> None:
    images = [square(RED), square(GREEN), square(BLUE)]
    env = PictureEnv([[images[0]], [images[1]], [images[2]]], turns=3)
    harness = _harness(processor, env, segment_max_images=2)
    harness.reset()
    assert not harness.step(_completion(processor, "red")).new_sample
    restarted = harness.step(_completion(processor, "green"))
    assert restarted.new_sample  # a third image would make three in one context
    restart_text = "Earlier in this episode you took these actions, in order:\n1. red\n2. green"
    expected = _processor_ids(
        processor, [_user([images[2]], f"{restart_text}\n\nlook 2")], [images[2]]
    )
    assert restarted.prompt_ids == expected == harness.context_ids
    harness.step(_completion(processor, "blue"))
    data = harness.get_episode_data()
    assert data.info["restart"]["kept_turns"] == 0
    first, second = data.samples
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert first.images is not None
    assert first.images.images == (images[0], images[1])
    assert second.images is not None
    assert second.images.images == (images[2],)
    for sample in data.samples:
        assert sample.images is not None
        assert (
            list(sample.token_ids).count(pad)
            == sample.images.placeholder_tokens
            == 4 * len(sample.images)
        )
    assert torch.equal(
        second.images.tensors["pixel_values"],
        processor.image_processor(images=[images[2]], return_tensors="pt")["pixel_values"],
    )


def test_images_travel_as_base64_png_values(processor: Any) -> None:
    image = square((10, 20, 30))
    harness = _harness(processor, PictureEnv([[encode_image(image)]], turns=1))
    harness.reset()
    shown = harness.context_images
    assert shown is not None
    assert shown.images[0].tobytes() == image.tobytes()


def test_an_image_that_does_not_decode_fails_the_episode(processor: Any) -> None:
    env = PictureEnv([[square(RED)], [b"not an image at all"]], turns=3)
    harness = _harness(processor, env)
    harness.reset()
    result = harness.step(_completion(processor, "red"))
    assert result.done
    data = harness.get_episode_data()
    assert data.stop_reason is StopReason.ENV_ERROR
    assert data.info["error"].startswith(
        "ImageObservationError: observation image 1 of 1 could not be decoded (19 bytes that "
        "are no image format PIL reads: "
    )
    assert "images" not in data.info  # the env's images are shown, not kept in the info
    (sample,) = data.samples  # what was played before stays readable
    assert sample.images is not None
    assert len(sample.images) == 1


def test_too_many_images_in_one_observation(processor: Any) -> None:
    env = PictureEnv([[square(RED)] * 3], turns=1)
    harness = _harness(processor, env, segment_max_images=2)
    with pytest.raises(ImageObservationError) as caught:
        harness.reset()
    assert str(caught.value) == (
        "the env sent 3 images in one observation, more than segment_max_images=2: raise "
        "segment_max_images, or send fewer images per observation"
    )


def test_images_for_a_text_only_policy(processor: Any) -> None:
    harness = RolloutHarness.local(PictureEnv([[square(RED)]], turns=1), processor.tokenizer)
    with pytest.raises(
        ImageObservationError, match=re.escape("the env sent 1 image but the policy is text-only")
    ):
        harness.reset()


def test_a_bad_image_fails_its_episode_not_the_batch(processor: Any) -> None:
    def factory(bad: list[bool] = [True, False]) -> RolloutHarness:  # noqa: B006 - a queue
        images = [b"\x89PNG broken"] if bad.pop(0) else [square(RED)]
        return _harness(processor, PictureEnv([images], turns=1), max_turns=1)

    collector = RolloutCollector(factory, batch_size=1, group_size=2, io_timeout_s=60)
    try:
        batch = collector.collect(
            lambda contexts: [_completion(processor, "red") for _ in contexts]
        )
    finally:
        collector.close()
    failed, played = batch.trajectories
    assert failed.failed
    assert failed.episode.info["error"].startswith(
        "ImageObservationError: observation image 1 of 1 could not be decoded"
    )
    assert not played.failed
    assert played.episode.stop_reason is StopReason.TERMINATED


# A LLaVA-style processor over a real SentencePiece tokenizer (Mistral's v3: `[INST]` and
# `[/INST]` are control tokens, words start with `▁`): a different placeholder rule (a fixed
# count per image, no delimiters) and a template whose boundaries are not all special tokens.
_MISTRAL_VLM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>\n{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% endif %}[/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def llava_processor() -> Any:
    from real_tokenizers import load_mistral_tokenizer
    from transformers import LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    tokenizer = load_mistral_tokenizer("mistral_v3")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = _MISTRAL_VLM_TEMPLATE
    images = LlavaImageProcessorPil(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
    )
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=_MISTRAL_VLM_TEMPLATE,
    )


def test_a_sentencepiece_llava_processor_renders_the_same_ids(llava_processor: Any) -> None:
    processor, tokenizer = llava_processor, llava_processor.tokenizer
    first, second = square(RED, 40, 60), square(BLUE, 90, 30)
    env = PictureEnv([[first], [second], []], turns=2, text="Which colour?")
    harness = RolloutHarness.local(env, tokenizer, 2, vision_processor=processor)
    harness.reset()
    # the ids the template's rendering gives the answer after `[/INST]`: `red`, not `▁red`
    inst_end = tokenizer.convert_tokens_to_ids("[/INST]")
    answer = tokenizer.encode("[/INST]red", add_special_tokens=False)
    assert answer[0] == inst_end
    completion = [*answer[1:], tokenizer.eos_token_id]
    harness.step(completion)
    messages = [
        _user([first], "Which colour? 0"),
        {"role": "assistant", "content": "red"},
        _user([second], "Which colour? 1"),
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<s>[INST] <image>\nWhich colour? 0[/INST]red</s>[INST] <image>\n")
    expected = list(
        processor(text=[text], images=[first, second], add_special_tokens=False)["input_ids"][0]
    )
    assert harness.context_ids == expected
    # 28 x 28 pixels after the crop: 2 x 2 patches of 14, the class token dropped
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    assert expected.count(image_id) == 8
    shown = harness.context_images
    assert shown is not None
    assert shown.placeholder_tokens == 8
    assert tuple(shown.tensors["pixel_values"].shape) == (2, 3, 28, 28)


def test_the_continuous_path_refuses_image_prompts_per_episode(processor: Any) -> None:
    from agile_llmenvs.backends.types import Generation, SamplingParams

    class IdsOnly:  # an AsyncTokenBackend (a `vllm serve` one, say): ids in, ids out
        version = 0

        async def agenerate(self, prompt: Any, params: Any) -> Generation:
            raise AssertionError("must not be asked to generate blind")

    def factory() -> RolloutHarness:
        return _harness(processor, PictureEnv([[square(RED)]], turns=1), max_turns=1)

    collector = RolloutCollector(factory, batch_size=1, group_size=2, io_timeout_s=60)
    try:
        batch = collector.collect_continuous(IdsOnly(), SamplingParams(max_tokens=2, seed=0))
    finally:
        collector.close()
    assert [t.episode.info["error"] for t in batch.trajectories] == [
        "IdsOnly generates from ids alone but the prompt shows images: play image envs on the "
        "lock-step path with the HF backend"
    ] * 2
