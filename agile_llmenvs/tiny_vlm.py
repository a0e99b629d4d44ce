"""A tiny, fully offline vision-language model: Qwen2-VL's architecture at toy size.

:func:`build_tiny_vlm` saves the tiny tokenizer (:mod:`agile_llmenvs.tiny_model`'s, plus
Qwen2-VL's vision tokens and a chat template that renders image parts), a Qwen2-VL image
processor sized for small images (a 56x56 image is 4 image tokens), and a random-init
``Qwen2VLForConditionalGeneration`` (a one-block vision tower, the tiny text decoder), in
float32 safetensors. Nothing is downloaded; equal arguments give identical weights.

:func:`load_processor` loads the processor of any model directory. Qwen2-VL's own processor
also needs a video processor, which needs ``torchvision``; the tiny model's processor is
:class:`ImageQwen2VLProcessor`, the same processor without videos, so it loads without it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from agile_llmenvs._cache import cache_root
from agile_llmenvs.errors import AgileLLMEnvsError
from agile_llmenvs.tiny_model import (
    ENDOFTEXT,
    IM_END,
    _build_tokenizer,
    _qwen2_tokenizer_config,
    _read_marker,
    build_in_place,
)

__all__ = [
    "IMAGE_TOKEN",
    "VLM_CHAT_TEMPLATE",
    "build_tiny_vlm",
    "default_tiny_vlm_dir",
    "ensure_tiny_vlm",
    "load_processor",
]

_FORMAT_VERSION = 1  # bump when a change here changes what a build holds
VISION_START, VISION_END, IMAGE_TOKEN, VIDEO_TOKEN = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
_VISION_TOKENS = (VISION_START, VISION_END, IMAGE_TOKEN, VIDEO_TOKEN)
#: The smallest and largest image area the image processor resizes to (28 = patch 14 x merge 2).
MIN_PIXELS, MAX_PIXELS = 28 * 28, 56 * 56

#: ChatML with Qwen2-VL's image parts: a message's content is a string, or a list of
#: ``{"type": "image"}`` / ``{"type": "text", "text": ...}`` parts rendered in order.
VLM_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' }}{%- generation %}"
    "{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _processor_class() -> type:
    from transformers import Qwen2VLProcessor

    class ImageQwen2VLProcessor(Qwen2VLProcessor):
        """Qwen2-VL's processor for images only: no video processor, so no ``torchvision``."""

        @classmethod
        def get_attributes(cls) -> list[str]:
            return ["image_processor", "tokenizer"]

    return ImageQwen2VLProcessor


def __getattr__(name: str) -> Any:
    if name == "ImageQwen2VLProcessor":  # built on first use: transformers loads lazily
        cls = _processor_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class TinyVLMError(AgileLLMEnvsError, ValueError):
    """A tiny vision-language model could not be built where it was asked for."""


def _image_processor(saved: dict[str, Any] | None = None) -> Any:
    """Qwen2-VL's image processor (its PIL one: no ``torchvision``), as saved or as built."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    if saved:
        settings = {k: v for k, v in saved.items() if k != "image_processor_type"}
        return Qwen2VLImageProcessorPil(**settings)
    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def _build(tmp: Path, args: dict[str, Any]) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tokenizer = _build_tokenizer(args["vocab_size"])
    tokenizer.add_special_tokens({"additional_special_tokens": list(_VISION_TOKENS)})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    processor = _processor_class()(
        image_processor=_image_processor(), tokenizer=tokenizer, chat_template=VLM_CHAT_TEMPLATE
    )
    processor.save_pretrained(tmp)
    _qwen2_tokenizer_config(tmp / "tokenizer_config.json")
    token_ids = dict(
        zip(
            ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
            tokenizer.convert_tokens_to_ids(list(_VISION_TOKENS)),
            strict=True,
        )
    )
    eos, pad = tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    hidden = args["hidden_size"]
    head_dim = hidden // 4
    text = {
        "vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": args["num_layers"], "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 2048,
        "rope_parameters": {"rope_type": "default", "mrope_section": _mrope(head_dim),
                            "rope_theta": 1000000.0},
        "bos_token_id": pad, "eos_token_id": eos, "pad_token_id": pad,
    }  # fmt: skip
    vision = {
        "depth": 1, "embed_dim": 32, "hidden_size": hidden, "num_heads": 2, "mlp_ratio": 2,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
    }  # fmt: skip
    config = Qwen2VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=True, **token_ids
    )
    config.dtype = torch.float32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args["seed"])
        model = Qwen2VLForConditionalGeneration(config).float().eval()
    ids = {"bos_token_id": pad, "eos_token_id": eos, "pad_token_id": pad}
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(tmp, safe_serialization=True)


def _mrope(head_dim: int) -> list[int]:
    """Qwen2-VL's split of the rotary half-dimension over (time, height, width)."""
    half = head_dim // 2
    return [half // 4, half // 4, half - 2 * (half // 4)]


def build_tiny_vlm(
    output_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    vocab_size: int = 450,
    hidden_size: int = 64,
    num_layers: int = 2,
    overwrite: bool = False,
) -> Path:
    """Build the tiny vision-language model into ``output_dir``, offline (a few seconds).

    It loads with ``Qwen2VLForConditionalGeneration.from_pretrained`` (or
    ``AutoModelForImageTextToText``) and :func:`load_processor`. Built in a sibling temporary
    directory renamed into place when complete; a directory already holding the same build is
    returned as is.

    Args:
        output_dir: Where the model goes; created if missing.
        seed: Seed of the weight initialisation.
        vocab_size: BPE vocabulary of the text tokenizer (before the four vision tokens).
        hidden_size: Text decoder width (a multiple of 16; the vision tower projects to it).
        num_layers: Text decoder layers.
        overwrite: Replace whatever ``output_dir`` holds if it is not the same build.

    Raises:
        TinyVLMError: an argument is out of range, or ``output_dir`` holds something else and
            ``overwrite`` is False.
    """
    if vocab_size < 259 or hidden_size % 16 or min(hidden_size, num_layers) < 1:
        raise TinyVLMError(
            "Need vocab_size >= 259, hidden_size a positive multiple of 16 and num_layers >= 1; "
            f"got {vocab_size}, {hidden_size} and {num_layers}."
        )
    out = Path(output_dir).expanduser().absolute()
    args = {"format_version": _FORMAT_VERSION, "kind": "tiny_vlm", "seed": seed}
    args.update(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers)
    if _read_marker(out) == args:
        return out
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise TinyVLMError(
            f"{out} already holds other files, not the tiny VLM asked for ({args}). Pass "
            "overwrite=True to replace it, or choose another output_dir."
        )
    build_in_place(out, args, _build, overwrite=overwrite)
    return out


def default_tiny_vlm_dir() -> Path:
    """Where the default tiny VLM is cached (beside the tiny model: ``$AGILE_LLMENVS_CACHE``,
    else ``~/.cache/agile_llmenvs``)."""
    return cache_root() / f"tiny-vlm-v{_FORMAT_VERSION}"


def ensure_tiny_vlm() -> Path:
    """Build the default tiny VLM into :func:`default_tiny_vlm_dir` unless it is there."""
    return build_tiny_vlm(default_tiny_vlm_dir())


def is_vision_model(path: str | os.PathLike[str]) -> bool:
    """Whether the model directory holds a vision-language model (a ``vision_config``)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "vision_config" in config


def load_processor(path: str | os.PathLike[str]) -> Any:
    """The processor saved in a model directory (the tiny VLM's without ``torchvision``).

    Raises:
        AgileLLMEnvsError: the directory has no processor a vision-language model needs.
    """
    folder = Path(path)
    try:
        saved = json.loads((folder / "processor_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        saved = {}
    if saved.get("processor_class") == "ImageQwen2VLProcessor":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        image_processor = _image_processor(saved.get("image_processor"))
        return _processor_class()(
            image_processor=image_processor, tokenizer=tokenizer, chat_template=template
        )
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(folder)
    except Exception as exc:
        raise AgileLLMEnvsError(
            f"{folder}: could not load the vision-language model's processor "
            f"({type(exc).__name__}: {exc}); save one beside the model "
            "(processor.save_pretrained)"
        ) from exc
