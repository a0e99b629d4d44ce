"""Training on images: the trainer scores exactly what the policy saw (its pixels beside its
ids), micro-batched like text; generation takes the images; GRPO learns a visual task."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from image_envs import PictureEnv, square

from agile_llmenvs.backends import HFBackend, SamplingParams
from agile_llmenvs.core.images import ImagePrompt, image_model_inputs
from agile_llmenvs.llm_envs import RolloutCollector, RolloutHarness
from agile_llmenvs.specs import ModelSpec, TrainingSpec, load_manifest
from agile_llmenvs.tiny_vlm import load_processor
from agile_llmenvs.training import train_grpo
from agile_llmenvs.training.generation import Sampler
from agile_llmenvs.training.grpo import build_policy_batch
from agile_llmenvs.training.objective import scored_token_logps

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"


@pytest.fixture(scope="module")
def vlm(tiny_vlm_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).eval()
    return model, load_processor(tiny_vlm_dir)


def _rollout(model: Any, processor: Any) -> Any:
    """Two one-turn episodes showing images of different sizes, sampled by the VLM."""
    images = iter([square((200, 30, 30)), square((30, 30, 200), 56, 28)])

    def factory() -> RolloutHarness:
        env = PictureEnv([[next(images)]], turns=1)
        return RolloutHarness.local(env, processor.tokenizer, 1, vision_processor=processor)

    backend = HFBackend.from_model(model, processor.tokenizer)
    sampler = Sampler(backend, SamplingParams(max_tokens=4, temperature=1.0, seed=0))
    collector = RolloutCollector(factory, batch_size=1, group_size=2, io_timeout_s=60)
    try:
        return collector.collect(sampler)
    finally:
        collector.close()


def _own_logps(model: Any, sample: Any) -> list[float]:
    """The model's log-probs of a sample's sampled ids, from its own full forward."""
    ids = torch.tensor([sample.token_ids])
    pad = model.config.image_token_id
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            pixel_values=sample.images.tensors["pixel_values"],
            image_grid_thw=sample.images.tensors["image_grid_thw"],
            mm_token_type_ids=(ids == pad).long(),
        ).logits[0, :-1]
    logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    return [float(v) for v, sampled in zip(logps, sample.action_mask, strict=True) if sampled]


def test_the_trainer_scores_what_the_sampler_saw(vlm: tuple[Any, Any]) -> None:
    model, processor = vlm
    rollout = _rollout(model, processor)
    samples = [t.episode.sample for t in rollout.trajectories]
    assert [len(s.images) for s in samples] == [1, 1]
    batch = build_policy_batch(rollout, torch.tensor([1.0, -1.0]), pad_id=0)
    assert batch.images_B == tuple(s.images for s in samples)
    whole = scored_token_logps(
        model,
        batch.input_ids_BT,
        batch.attention_mask_BT,
        batch.action_mask_BT,
        model_inputs=image_model_inputs(batch.images_B, batch.input_ids_BT, model),
    ).logps_BT
    for row, sample in enumerate(samples):
        micro = batch.select(slice(row, row + 1))
        alone = scored_token_logps(
            model,
            micro.input_ids_BT,
            micro.attention_mask_BT,
            micro.action_mask_BT,
            model_inputs=image_model_inputs(micro.images_B, micro.input_ids_BT, model),
        ).logps_BT[0][micro.action_mask_BT[0]]
        own = torch.tensor(_own_logps(model, sample))
        # one row alone, the two together, the model's own forward, and the sampler's record
        torch.testing.assert_close(alone, own, atol=1e-5, rtol=0)
        width = micro.action_mask_BT.shape[1]
        torch.testing.assert_close(
            whole[row, :width][micro.action_mask_BT[0]], own, atol=1e-5, rtol=0
        )
        torch.testing.assert_close(torch.tensor(sample.sampling_logps), own, atol=1e-4, rtol=0)


def test_the_pixels_change_the_scores(vlm: tuple[Any, Any]) -> None:
    model, processor = vlm
    rollout = _rollout(model, processor)
    batch = build_policy_batch(rollout, torch.tensor([1.0, -1.0]), pad_id=0).select(slice(0, 1))
    inputs = image_model_inputs(batch.images_B, batch.input_ids_BT, model)
    args = (batch.input_ids_BT, batch.attention_mask_BT, batch.action_mask_BT)
    seen = scored_token_logps(model, *args, model_inputs=inputs).logps_BT
    dark = {**inputs, "pixel_values": torch.zeros_like(inputs["pixel_values"])}
    blind = scored_token_logps(model, *args, model_inputs=dark).logps_BT
    assert not torch.allclose(seen, blind)


def test_misaligned_images_are_refused(vlm: tuple[Any, Any]) -> None:
    model, processor = vlm
    batch = build_policy_batch(_rollout(model, processor), torch.tensor([1.0, -1.0]), pad_id=0)
    swapped = (batch.images_B[0], None)
    with pytest.raises(ValueError, match=r"^row 1 holds 2 image placeholder tokens but its 0 "):
        image_model_inputs(swapped, batch.input_ids_BT, model)


def test_batched_generation_with_images_equals_each_prompt_alone(vlm: tuple[Any, Any]) -> None:
    model, processor = vlm
    prompts = []
    for colour, size in (((200, 30, 30), (56, 56)), ((30, 200, 30), (28, 56))):
        harness = RolloutHarness.local(
            PictureEnv([[square(colour, *size)]], turns=1),
            processor.tokenizer,
            vision_processor=processor,
        )
        harness.reset()
        images = harness.context_images
        assert images is not None
        prompts.append(ImagePrompt(harness.context_ids, images))
    assert len(prompts[0]) != len(prompts[1])  # the shorter one is left-padded in the batch
    backend = HFBackend.from_model(model, processor.tokenizer)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    together = backend.generate(prompts, greedy)
    alone = [backend.generate([p], greedy)[0] for p in prompts]
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    image_ids = {model.config.image_token_id, model.config.video_token_id}
    assert not image_ids & {t for g in together for t in g.token_ids}


def test_a_text_only_generator_refuses_image_prompts(vlm: tuple[Any, Any]) -> None:
    _, processor = vlm

    class IdsOnly:
        def generate(self, prompts: Any, params: Any) -> list[Any]:
            raise AssertionError("must not be called")

    harness = RolloutHarness.local(
        PictureEnv([[square((1, 2, 3))]], turns=1), processor.tokenizer, vision_processor=processor
    )
    harness.reset()
    prompt = ImagePrompt(harness.context_ids, harness.context_images)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="generates from ids alone") as caught:
        Sampler(IdsOnly(), SamplingParams(max_tokens=1))([prompt])
    assert str(caught.value) == (
        "IdsOnly generates from ids alone but these prompts show images: generate with the HF "
        "backend (training.generation_backend: hf)"
    )


@pytest.mark.slow
def test_grpo_learns_the_colour_of_the_square(tiny_vlm_dir: Path, tmp_path: Path) -> None:
    # the shipped manifest, cut to 200 steps: ~100 s on 2 cores
    manifest = load_manifest(MANIFESTS / "grpo_colour_squares.yaml")
    assert manifest.training is not None
    training = {**manifest.training.model_dump(exclude_unset=True), "max_steps": 200}
    manifest = manifest.model_copy(
        update={
            "model": ModelSpec(path=str(tiny_vlm_dir)),
            "training": TrainingSpec.model_validate({**training, "output_dir": str(tmp_path)}),
        }
    )
    result = train_grpo(manifest)
    rewards = [row["reward_mean"] for row in result.metrics]
    first, last = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
    assert first < 0.1, rewards[:20]
    # the colour is only in the image, drawn uniformly from three: a policy that does not read
    # the image scores at most 1/3 in expectation
    assert last > 0.6, rewards[-20:]
    saved = result.checkpoint_dir / "model"
    assert (saved / "processor_config.json").exists()
    assert type(load_processor(saved)).__name__ == "ImageQwen2VLProcessor"
