"""Evaluating on an env that shows images: a vision-language model is shown each episode's
image exactly as its processor renders it, a text-only model fails its episodes (the run goes
on), and a backend that cannot take images stops the run saying what to use instead."""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from fakes import ChatAPIServer
from image_envs import PictureEnv, square
from PIL import ImageChops

from agile_llmenvs.backends import HFBackend, SamplingParams
from agile_llmenvs.core import from_text_env
from agile_llmenvs.core.images import ImagePrompt
from agile_llmenvs.envs.colour_squares import ColourSquareEnv
from agile_llmenvs.errors import EvaluationError
from agile_llmenvs.evaluation import ImageChatBackend, StopReason, run_evaluation
from agile_llmenvs.evaluation.command import register
from agile_llmenvs.tiny_vlm import load_processor

ROOT = Path(__file__).resolve().parents[2]
COLOUR_EVAL = ROOT / "manifests" / "eval" / "colour_squares.yaml"
SEED = 1000  # the shipped config's: task i is the square ColourSquareEnv draws with SEED + i
TEXT_ONLY = (
    "ImageObservationError: the env sent 1 image but the policy is text-only (HFBackend's "
    "model has no vision part): evaluate a vision-language model, or an env that sends text "
    "only"
)


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agile-llmenvs")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.run(args))


def report_of(tmp_path: Path, *flags: str) -> dict[str, Any]:
    """``agile-llmenvs eval`` of the shipped colour-squares config; its results file."""
    output = tmp_path / "results.json"
    assert run(["eval", str(COLOUR_EVAL), "--output", str(output), *flags]) == 0
    report: dict[str, Any] = json.loads(output.read_text(encoding="utf-8"))
    return report


@pytest.fixture
def prompts(monkeypatch: pytest.MonkeyPatch) -> list[Sequence[int]]:
    """Every prompt HFBackend.generate is given, in order (ImagePrompts keep their images)."""
    seen: list[Sequence[int]] = []
    generate = HFBackend.generate

    def spy(self: HFBackend, batch: Sequence[Sequence[int]], params: Any, **kwargs: Any) -> Any:
        seen.extend(batch)
        return generate(self, batch, params, **kwargs)

    monkeypatch.setattr(HFBackend, "generate", spy)
    return seen


def rendered(processor: Any, messages: list[dict[str, Any]], images: list[Any]) -> Any:
    """The processor's own rendering of a conversation: its chat template, then the
    processor over that text and the images."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=images, return_tensors="pt")


def asks(question: str) -> dict[str, Any]:
    """A user message showing one image before ``question``."""
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}


def same_image(a: Any, b: Any) -> bool:
    return a.size == b.size and ImageChops.difference(a, b).getbbox() is None


# --------------------------------------------------------------------------- the CLI


def test_a_vision_language_model_is_shown_each_episode_image(
    tiny_vlm_dir: Path, tmp_path: Path, prompts: list[Sequence[int]]
) -> None:
    report = report_of(tmp_path, "--model", str(tiny_vlm_dir), "--limit", "3")
    [env] = report["environments"]
    assert (env["num_tasks"], env["num_errors"]) == (3, 0)
    processor = load_processor(tiny_vlm_dir)
    assert len(prompts) == 3  # one single-turn episode each, in task order
    for task, (prompt, trajectory) in enumerate(zip(prompts, env["trajectories"], strict=True)):
        question, info = ColourSquareEnv().reset(seed=SEED + task)
        [image] = info["images"]
        expected = rendered(processor, [asks(question)], [image])
        assert isinstance(prompt, ImagePrompt)
        assert list(prompt) == expected["input_ids"][0].tolist()
        assert same_image(prompt.images.images[0], image)
        assert torch.equal(prompt.images.tensors["pixel_values"], expected["pixel_values"])
        assert torch.equal(prompt.images.tensors["image_grid_thw"], expected["image_grid_thw"])
        assert trajectory["messages"][0] == asks(question)  # the image part, without pixels
        assert trajectory["stop_reason"] == "terminated"


def test_a_text_only_model_fails_each_episode_and_the_run_completes(
    tiny_model_dir: Path,
    tmp_path: Path,
    prompts: list[Sequence[int]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = report_of(tmp_path, "--model", str(tiny_model_dir), "--limit", "3")
    [env] = report["environments"]
    assert [(t["stop_reason"], t["error"]) for t in env["trajectories"]] == [
        ("env_error", TEXT_ONLY)
    ] * 3
    assert (env["num_errors"], env["success_rate"]) == (3, 0.0)
    assert prompts == []  # nothing generated from a conversation missing its image
    out = capsys.readouterr().out
    assert out.splitlines()[2].split() == ["colour_squares", "3", "0.0%", "0.000", "0.00", "3"]


@pytest.mark.parametrize("backend", ["openai", "vllm_server"])
def test_a_backend_that_cannot_take_images_stops_the_run(
    backend: str,
    tiny_model_dir: Path,
    tmp_path: Path,
    server: ChatAPIServer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = {
        "openai": f"{{backend: openai, model: m, base_url: '{server.openai_url}'}}",
        "vllm_server": f"{{backend: vllm_server, model: '{tiny_model_dir}', "
        "urls: ['http://127.0.0.1:9']}",
    }[backend]
    config = tmp_path / "eval.yaml"
    config.write_text(
        f"environments: [{{name: colours, source: manifest, manifest: '{COLOUR_EVAL.parent}/"
        f"../grpo_colour_squares.yaml', size: 2}}]\nmodel: {model}\n",
        encoding="utf-8",
    )
    assert run(["eval", str(config)]) == 2
    name = {"openai": "OpenAIBackend", "vllm_server": "VLLMServerBackend"}[backend]
    assert capsys.readouterr().err.endswith(
        f"error: the env sent 1 image, but {name} cannot show images to its model (it sends a "
        "conversation's text alone): evaluate a vision-language model with backend: "
        "huggingface, which frames the images with the model's processor\n"
    )
    assert server.requests == []


# --------------------------------------------------------------------------- the API


def test_a_later_observation_shows_its_image_after_the_earlier_turns(
    tiny_vlm_dir: Path, prompts: list[Sequence[int]]
) -> None:
    red, blue = square((230, 25, 25)), square((25, 25, 230))
    buffer = io.BytesIO()
    blue.save(buffer, format="PNG")  # the second observation's image comes as PNG bytes
    env = from_text_env(lambda: PictureEnv([[red], [buffer.getvalue()]], turns=2), name="look")
    processor = load_processor(tiny_vlm_dir)
    backend = ImageChatBackend(HFBackend(tiny_vlm_dir), processor)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    result = run_evaluation(env, backend, params, num_tasks=1, system_prompt="Look.")
    [trajectory] = result.trajectories
    assert trajectory.stop_reason is StopReason.TERMINATED
    assert "images" not in trajectory.turns[0].info  # they went to the policy
    conversation = [
        {"role": "system", "content": "Look."},
        asks("look 0"),
        {"role": "assistant", "content": trajectory.turns[0].action.text},
        asks("look 1"),
    ]
    first, second = prompts
    assert list(first) == rendered(processor, conversation[:2], [red])["input_ids"][0].tolist()
    expected = rendered(processor, conversation, [red, blue])
    assert isinstance(second, ImagePrompt)
    assert list(second) == expected["input_ids"][0].tolist()
    assert torch.equal(second.images.tensors["pixel_values"], expected["pixel_values"])
    record = result.to_dict()["trajectories"][0]["messages"]
    assert [m["content"] for m in record[1::2]] == [
        asks("look 0")["content"],
        asks("look 1")["content"],
        "look 2",  # the last observation, after the episode ended: text only
    ]


def test_an_hf_backend_over_a_vision_model_needs_its_processor(tiny_vlm_dir: Path) -> None:
    env = from_text_env(ColourSquareEnv, name="colours")
    with pytest.raises(EvaluationError) as caught:
        run_evaluation(env, HFBackend(tiny_vlm_dir), num_tasks=1)
    assert str(caught.value) == (
        "the env sent 1 image, and HFBackend holds a vision-language model but no processor to "
        "frame images with: generate through ImageChatBackend(backend, load_processor(model_dir)) "
        "(agile-llmenvs eval does so for backend: huggingface)"
    )


def test_image_chat_needs_a_model_that_sees(tiny_model_dir: Path, tiny_vlm_dir: Path) -> None:
    with pytest.raises(EvaluationError) as caught:
        ImageChatBackend(HFBackend(tiny_model_dir), load_processor(tiny_vlm_dir))
    assert str(caught.value) == (
        "ImageChatBackend needs a backend that generates with images (HFBackend over a "
        "vision-language model); HFBackend generates from text alone"
    )
