"""The images of a token sequence, and the model inputs a batch of them makes.

A vision-language prompt is ids in which each image stands as its placeholder tokens (the
processor's expansion: Qwen2-VL's ``<|image_pad|>`` once per merged patch) plus the
processor's tensors for those images. :class:`SampleImages` keeps both together, so a
trainer scores a sample with exactly the pixels the policy was shown.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "TOKEN_ALIGNED_KEYS",
    "ImagePrompt",
    "SampleImages",
    "image_model_inputs",
    "prompt_images",
]

#: Processor outputs laid along the tokens, not the images: rebuilt for each batch.
TOKEN_ALIGNED_KEYS = frozenset(
    {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"}
)


@dataclass(frozen=True)
class SampleImages:
    """The images of one token sequence, in the order of their placeholders in its ids.

    Attributes:
        images: The images, as the env sent them (decoded to RGB PIL images).
        tensors: The processor's per-image outputs (``pixel_values``, ``image_grid_thw``...),
            each the images' values concatenated along dim 0.
        placeholder_tokens: How many image placeholder tokens the images stand for in the ids.
    """

    images: tuple[Any, ...] = ()
    tensors: Mapping[str, Any] = field(default_factory=dict)
    placeholder_tokens: int = 0

    def __len__(self) -> int:
        return len(self.images)

    def __add__(self, other: SampleImages) -> SampleImages:
        """Both images' lists, ``self``'s first (a sample extended by a turn)."""
        if not other.images:
            return self
        if not self.images:
            return other
        return SampleImages(
            self.images + other.images,
            _concat([self.tensors, other.tensors]),
            self.placeholder_tokens + other.placeholder_tokens,
        )


class ImagePrompt(list[int]):
    """A prompt's ids that show images: the ids (a ``list[int]``), with :attr:`images` beside.

    A collector hands these to its policy for contexts that show images, so a policy that
    reads only ids still gets ids, and one that can look (:class:`HFBackend` over a
    vision-language model) finds the pixels with them.
    """

    def __init__(self, ids: Sequence[int], images: SampleImages) -> None:
        super().__init__(ids)
        self.images = images


def prompt_images(prompts: Sequence[Sequence[int]]) -> list[SampleImages | None]:
    """Each prompt's images (None for a prompt of ids alone)."""
    return [getattr(prompt, "images", None) for prompt in prompts]


def image_model_inputs(
    rows: Sequence[SampleImages | None],
    input_ids_BT: Any,
    model: Any,
) -> dict[str, Any]:
    """The image inputs of ``model``'s forward for a batch whose row ``b`` holds
    ``rows[b]``'s placeholders: every row's tensors concatenated in row order, and for a
    model that takes them (Qwen2-VL), ``mm_token_type_ids`` (1 on image placeholders).

    Returns ``{}`` when no row has images.

    Raises:
        ValueError: a row's ids hold a different number of placeholders than its images.
    """
    present = [row for row in rows if row is not None and row.images]
    if not present:
        return {}
    inputs = dict(_concat([row.tensors for row in present]))
    device = input_ids_BT.device
    inputs = {k: v.to(device) if hasattr(v, "to") else v for k, v in inputs.items()}
    config = getattr(model, "config", None)
    image_token = getattr(config, "image_token_id", None)
    if image_token is None:
        image_token = getattr(config, "image_token_index", None)
    if image_token is not None:
        counts = (input_ids_BT == image_token).sum(dim=1).tolist()
        for b, row in enumerate(rows):
            expected = row.placeholder_tokens if row is not None else 0
            if counts[b] != expected:
                raise ValueError(
                    f"row {b} holds {counts[b]} image placeholder tokens but its "
                    f"{0 if row is None else len(row)} images stand for {expected}: the ids and "
                    "the images are not aligned"
                )
        if _takes(model, "mm_token_type_ids"):
            inputs["mm_token_type_ids"] = (input_ids_BT == image_token).long()
    return inputs


def _takes(model: Any, name: str) -> bool:
    import inspect

    while hasattr(model, "module"):
        model = model.module
    get_base = getattr(model, "get_base_model", None)
    model = get_base() if callable(get_base) else model
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _concat(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    import torch

    keys = [key for key in parts[0] if key not in TOKEN_ALIGNED_KEYS]
    return {key: torch.cat([part[key] for part in parts], dim=0) for key in keys}
