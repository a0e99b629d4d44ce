"""SFT on rows that show images: each prompt is the processor's own ids, each batch row keeps
its pixels, the forward sees them micro-batched like text, and the tiny VLM learns."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from image_envs import square

from agile_llmenvs.envs import make_llm_env
from agile_llmenvs.llm_envs import DatasetEnv, SFTBatch
from agile_llmenvs.llm_envs.rows import DatasetError
from agile_llmenvs.specs import LLMEnvSpec, RunManifest
from agile_llmenvs.tiny_vlm import IMAGE_TOKEN, load_processor
from agile_llmenvs.training import train_sft
from agile_llmenvs.training.supervised import SFTObjective, labelled_logps
from agile_llmenvs.transport.images import ImageObservationError

RED, BLUE, GREEN = (200, 30, 30), (30, 30, 200), (30, 200, 30)
EMPTY = datasets.Dataset.from_list([])


@pytest.fixture(scope="module")
def vlm(tiny_vlm_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).eval()
    return model, load_processor(tiny_vlm_dir)


def png(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def b64(image: Any) -> str:
    return base64.b64encode(png(image)).decode("ascii")


def image_env(processor: Any, rows: list[dict[str, Any]], **kwargs: Any) -> DatasetEnv:
    """An SFT env whose test split is ``rows``, in order (``iter_test`` serves them as given)."""
    dataset = datasets.Dataset.from_list(rows)
    return DatasetEnv(
        dataset,
        dataset,
        processor.tokenizer,
        objective="sft",
        vision_processor=processor,
        data_batch_size_per_gpu=len(rows),
        **kwargs,
    )


# -- independent expectations ------------------------------------------------------------------


def processor_ids(processor: Any, prompt: str, image: Any, response: str = "") -> Any:
    """The processor's own ids (and tensors) of a user turn showing ``image``, then the
    generation prompt and, when given, ``response`` closing the assistant turn."""
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": prompt}],
        }
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if response:
        text += response + "<|im_end|>"
    return processor(text=[text], images=[image], add_special_tokens=False, return_tensors="pt")


def own_logps(model: Any, batch: SFTBatch, row: int) -> torch.Tensor:
    """Row ``row``'s response-token log-probs from the model's own full forward."""
    length = int(batch.attention_mask[row].sum())
    ids = batch.input_ids[row : row + 1, :length]
    images = batch.images_B[row]
    assert images is not None
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            pixel_values=images.tensors["pixel_values"],
            image_grid_thw=images.tensors["image_grid_thw"],
            mm_token_type_ids=(ids == model.config.image_token_id).long(),
        ).logits[0, :-1]
    logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    return logps[batch.labels[row, 1:length] != -100]


# -- the rows' ids -----------------------------------------------------------------------------


def test_an_image_rows_prompt_is_the_processors_own_ids(vlm: tuple[Any, Any]) -> None:
    _, processor = vlm
    rows = [
        {"prompt": "What colour is the square?", "response": "red", "image": square(RED)},
        {"prompt": "And this one?", "response": "deep blue", "image": square(BLUE, 28, 28)},
    ]
    shown = [
        {"prompt": r["prompt"], "response": r["response"], "images": [b64(r["image"])]}
        for r in rows
    ]
    env = image_env(processor, shown)
    batch = next(env.iter_test())
    assert isinstance(batch, SFTBatch)
    width = batch.input_ids.shape[1]
    image_token = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    for b, (row, placeholders) in enumerate(zip(rows, [4, 1], strict=True)):
        prompt = processor_ids(processor, row["prompt"], row["image"])
        whole = processor_ids(processor, row["prompt"], row["image"], row["response"])
        prompt_ids, ids = prompt["input_ids"][0].tolist(), whole["input_ids"][0].tolist()
        assert ids[: len(prompt_ids)] == prompt_ids
        fill = width - len(ids)
        assert batch.input_ids[b].tolist() == ids + [processor.tokenizer.pad_token_id] * fill
        assert batch.attention_mask[b].tolist() == [1] * len(ids) + [0] * fill
        # the labels are the response's ids and its closing <|im_end|>, nothing else
        response = processor.tokenizer.encode(row["response"], add_special_tokens=False)
        im_end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert ids[len(prompt_ids) :] == [*response, im_end]
        assert (
            batch.labels[b].tolist()
            == [-100] * len(prompt_ids) + [*response, im_end] + [-100] * fill
        )
        assert int(batch.prompt_lengths[b]) == len(prompt_ids)
        images = batch.images_B[b]
        assert images is not None
        assert images.placeholder_tokens == prompt_ids.count(image_token) == placeholders
        torch.testing.assert_close(images.tensors["pixel_values"], prompt["pixel_values"])
        assert torch.equal(images.tensors["image_grid_thw"], prompt["image_grid_thw"])
    assert batch.to("cpu").images_B == batch.images_B


def test_a_row_without_images_is_text_beside_rows_with_them(vlm: tuple[Any, Any]) -> None:
    model, processor = vlm
    rows = [
        {"prompt": "What colour?", "response": "red", "images": [square(RED)]},
        {"prompt": "Say hi", "response": "hi", "images": []},
    ]
    batch = next(image_env(processor, rows).iter_test())
    assert isinstance(batch, SFTBatch)
    assert batch.images_B[0] is not None
    assert len(batch.images_B[0]) == 1
    assert batch.images_B[1] is None
    messages = [{"role": "user", "content": "Say hi"}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert batch.input_ids[1, : len(prompt)].tolist() == prompt
    assert int(batch.prompt_lengths[1]) == len(prompt)
    with torch.no_grad():
        whole, mask = labelled_logps(
            model,
            batch.input_ids,
            batch.attention_mask,
            batch.labels,
            chunk_tokens=4,
            images_B=batch.images_B,
        )
        text = batch.input_ids[1:], batch.attention_mask[1:], batch.labels[1:]
        alone, alone_mask = labelled_logps(model, *text, chunk_tokens=4)  # no images at all
    torch.testing.assert_close(whole[1][mask[1]], alone[0][alone_mask[0]], atol=1e-5, rtol=0)


def test_image_paths_are_read_relative_to_the_dataset_file(
    vlm: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, processor = vlm
    (tmp_path / "pics").mkdir()
    square(GREEN).save(tmp_path / "pics" / "green.png")
    rows = tmp_path / "rows.jsonl"
    row = {"question": "What colour?", "response": "green", "pictures": ["pics/green.png"]}
    rows.write_text(json.dumps(row) + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    spec = LLMEnvSpec(
        env_type="dataset",
        objective="sft",
        dataset_path=str(rows),
        columns={"prompt": "question", "images": "pictures"},
    )
    env = make_llm_env(
        spec, processor.tokenizer, data_batch_size_per_gpu=1, vision_processor=processor
    )
    batch = env.next_batch()
    assert isinstance(batch, SFTBatch)
    expected = processor_ids(processor, "What colour?", square(GREEN), "green")
    assert batch.input_ids[0].tolist() == expected["input_ids"][0].tolist()
    images = batch.images_B[0]
    assert images is not None
    torch.testing.assert_close(images.tensors["pixel_values"], expected["pixel_values"])


def test_image_placeholders_count_toward_the_context_budget(vlm: tuple[Any, Any]) -> None:
    _, processor = vlm
    small, large = square(RED, 28, 28), square(RED, 56, 56)  # 1 and 4 placeholders
    short = len(processor_ids(processor, "Colour?", small)["input_ids"][0])
    assert len(processor_ids(processor, "Colour?", large)["input_ids"][0]) == short + 3
    rows = [
        {"prompt": "Colour?", "response": "red red red", "images": [large]},
        {"prompt": "Colour?", "response": "red red red", "images": [small]},
    ]
    # the large image's prompt alone is over the budget; the small one's keeps 2 tokens
    env = image_env(processor, rows, max_context_length=short + 2)
    assert env.dataset_size == {"train": 1, "test": 1}
    batch = next(env.iter_test())
    assert isinstance(batch, SFTBatch)
    assert batch.input_ids.shape == (1, short + 2)
    assert int((batch.labels != -100).sum()) == 2
    assert batch.images_B[0] is not None
    assert batch.images_B[0].placeholder_tokens == 1


# -- the forward -------------------------------------------------------------------------------


def two_image_rows(processor: Any) -> SFTBatch:
    rows = [
        {"prompt": "What colour is the square?", "response": "red", "images": [square(RED)]},
        {"prompt": "And this?", "response": "a blue one", "images": [square(BLUE, 56, 28)]},
    ]
    batch = next(image_env(processor, rows).iter_test())
    assert isinstance(batch, SFTBatch)
    return batch


def test_micro_batched_image_logps_equal_the_models_own_forward(vlm: tuple[Any, Any]) -> None:
    model, processor = vlm
    batch = two_image_rows(processor)

    def logps(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return labelled_logps(
                model,
                batch.input_ids[rows],
                batch.attention_mask[rows],
                batch.labels[rows],
                chunk_tokens=3,
                images_B=batch.images_B[rows],
            )

    whole, whole_mask = logps(slice(0, 2))
    for row in range(2):
        alone, alone_mask = logps(slice(row, row + 1))
        own = own_logps(model, batch, row)
        torch.testing.assert_close(alone[0][alone_mask[0]], own, atol=1e-5, rtol=0)
        torch.testing.assert_close(whole[row][whole_mask[row]], own, atol=1e-5, rtol=0)


def test_the_sft_loss_is_the_same_in_micro_batches(vlm: tuple[Any, Any]) -> None:
    model, processor = vlm
    batch = two_image_rows(processor)
    objective = SFTObjective(chunk_tokens=4)
    units = objective.units(batch)
    with torch.no_grad():
        whole, sums = objective.loss(model, batch, slice(0, 2), units)
        parts = [objective.loss(model, batch, slice(r, r + 1), units) for r in range(2)]
    torch.testing.assert_close(sum(loss for loss, _ in parts), whole, atol=1e-5, rtol=0)
    assert sums["tokens"] == units == sum(s["tokens"] for _, s in parts)
    own = torch.cat([own_logps(model, batch, row) for row in range(2)])
    torch.testing.assert_close(whole, -own.sum() / units, atol=1e-5, rtol=0)


def test_sft_on_images_lowers_the_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGILE_LLMENVS_CACHE", str(tmp_path / "cache"))  # model.builtin builds here
    colours = {"red": RED, "green": GREEN, "blue": BLUE}
    rows = tmp_path / "squares.jsonl"
    with rows.open("w") as out:
        for name, colour in colours.items():
            row = {"prompt": "What colour is the square?", "response": name}
            out.write(json.dumps({**row, "images": [b64(square(colour))]}) + "\n")
    manifest = RunManifest.model_validate(
        {
            "name": "image-sft",
            "env": {"env_type": "dataset", "objective": "sft", "dataset_path": str(rows)},
            "model": {"builtin": "tiny_vlm"},
            "training": {
                "algorithm": "sft",
                "max_steps": 12,
                "batch_size": 3,
                "micro_batch_size": 2,
                "learning_rate": 3e-3,
                "output_dir": str(tmp_path / "run"),
            },
            "seed": 0,
        }
    )
    result = train_sft(manifest)
    losses = [row["loss"] for row in result.metrics]
    assert len(losses) == 12
    assert losses[-1] < 0.5 * losses[0], losses


# -- errors ------------------------------------------------------------------------------------


def test_images_for_a_text_only_policy_are_refused(vlm: tuple[Any, Any]) -> None:
    _, processor = vlm
    rows = datasets.Dataset.from_list(
        [
            {"prompt": "Hi", "response": "hello", "images": []},
            {"prompt": "Colour?", "response": "red", "images": [b64(square(RED))]},
        ]
    )
    message = (
        "train row 1 shows 1 image but the policy is text-only: train a vision-language model "
        "(model.builtin: tiny_vlm, or a model.path with a vision_config; DatasetEnv's "
        "vision_processor), or drop the rows' `images` column"
    )
    with pytest.raises(ImageObservationError, match=f"^{re.escape(message)}$"):
        DatasetEnv(rows, EMPTY, processor.tokenizer, objective="sft")


def test_an_image_that_does_not_decode_names_its_row_and_index(vlm: tuple[Any, Any]) -> None:
    _, processor = vlm
    rows = datasets.Dataset.from_list(
        [
            {"prompt": "Colour?", "response": "red", "images": [png(square(RED))]},
            {"prompt": "Colour?", "response": "red", "images": [png(square(RED)), b"xyz"]},
        ]
    )
    message = (
        "train row 1 image 2 of 2 could not be decoded (3 bytes that are no image format PIL "
        "reads: cannot identify image file); send a PIL image, PNG or JPEG bytes, those bytes "
        "as base64 (or a data:image/...;base64, URL), or an H x W x 3 uint8 array"
    )
    with pytest.raises(ImageObservationError, match=f"^{re.escape(message)}$"):
        DatasetEnv(rows, EMPTY, processor.tokenizer, objective="sft", vision_processor=processor)


def test_a_path_is_not_base64_without_a_dataset_file(vlm: tuple[Any, Any]) -> None:
    _, processor = vlm
    rows = datasets.Dataset.from_list(
        [{"prompt": "Colour?", "response": "red", "images": ["pics/red.png"]}]
    )
    with pytest.raises(
        ImageObservationError, match=r"^test row 0 image 1 of 1 is a string that is not base64 "
    ):
        DatasetEnv(EMPTY, rows, processor.tokenizer, objective="sft", vision_processor=processor)


def test_preference_rows_with_images_are_not_supported_yet(vlm: tuple[Any, Any]) -> None:
    _, processor = vlm
    rows = datasets.Dataset.from_list(
        [{"prompt": "Colour?", "chosen": "red", "rejected": "blue", "images": [square(RED)]}]
    )
    message = (
        "train row 0 shows 1 image, but preference (DPO) training on images is not supported "
        "yet: drop the rows' `images` column, or train with SFT"
    )
    with pytest.raises(DatasetError, match=f"^{re.escape(message)}$"):
        DatasetEnv(
            rows, EMPTY, processor.tokenizer, objective="preference", vision_processor=processor
        )
