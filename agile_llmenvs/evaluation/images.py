"""Images in an evaluation: the env's images shown in the conversation, to a model that looks.

An env shows images beside its text in a reset's or step's ``info["images"]``, as it does for
the training harness. The runner moves them into the user message they came with, as image
parts (``{"type": "image", "image": <PIL image>}``), so a conversation carries its images.
Only a backend that shows them to its model may generate from such a conversation:
:class:`ImageChatBackend` frames each one exactly as the training harness does (the
processor's chat template, each placeholder expanded by the processor) and gives the token
backend the prompt ids with their images. ``agile-llmenvs eval`` wraps ``backend:
huggingface`` over a vision-language model in one.

Which backend meets images decides what happens (:func:`shown_images`): a text-only policy
(an HF backend over a text model) fails the episode, as the harness does, and the run goes
on; a backend that cannot take images at all (vLLM, a vLLM server, API backends) stops the run
with an :class:`~agile_llmenvs.errors.EvaluationError` saying what to use instead.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

from agile_llmenvs.backends.local import LocalChatBackend
from agile_llmenvs.backends.types import Generation, Messages, SamplingParams, Tools
from agile_llmenvs.core.images import ImagePrompt
from agile_llmenvs.errors import EvaluationError
from agile_llmenvs.llm_envs.framing import ChatFramer
from agile_llmenvs.llm_envs.image_framing import ImageFramer, message_images
from agile_llmenvs.transport.images import ImageObservationError, decode_image, image_count

__all__ = ["ImageChatBackend", "shown_images"]


class _ImageGenerator(Protocol):
    """A token backend that generates from :class:`ImagePrompt` ids (``HFBackend``)."""

    supports_images: bool

    @property
    def tokenizer(self) -> Any: ...

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation]: ...

    def close(self) -> None: ...


class ImageChatBackend(LocalChatBackend):
    """A chat backend over a vision-language model whose conversations may show images.

    Each conversation is framed as the training harness frames it (with the processor as
    its ``vision_processor``): rendered by the processor's chat template, then tokenized by
    the processor with the conversation's images, each placeholder expanded into the image's
    tokens. A conversation with images goes to the token backend as an
    :class:`~agile_llmenvs.core.images.ImagePrompt`, so it generates with the pixels.

    Args:
        backend: The token backend (``HFBackend`` over a vision-language model).
        processor: The model's processor (:func:`~agile_llmenvs.tiny_vlm.load_processor`).

    Raises:
        EvaluationError: ``backend`` cannot generate with images (a text-only model).
    """

    shows_images = True
    """What the runner reads: this backend's model sees the images of its conversations."""

    def __init__(self, backend: _ImageGenerator, processor: Any) -> None:
        if not getattr(backend, "supports_images", False):
            raise EvaluationError(
                f"ImageChatBackend needs a backend that generates with images (HFBackend over a "
                f"vision-language model); {type(backend).__name__} generates from text alone"
            )
        self.backend = backend
        self.processor = processor
        template = getattr(processor, "chat_template", None)
        self._template: dict[str, Any] = {"chat_template": template} if template else {}
        self._framers: dict[str, ImageFramer] = {}

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer."""
        return self.backend.tokenizer

    def encode_chat(self, messages: Messages, tools: Tools | None = None) -> list[int]:
        """The prompt ids of one conversation (an ``ImagePrompt`` when it shows images)."""
        framer = self._framer(tools)
        if message_images(messages):
            ids, images = framer.prompt(messages)
            return ImagePrompt(ids, images)
        return framer.framer.prompt(messages)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation]:
        """The token backend's ``generate`` (``ImagePrompt`` ids carry their images)."""
        return self.backend.generate(prompts, params)

    def close(self) -> None:
        """Close the token backend."""
        self.backend.close()

    def _framer(self, tools: Tools | None) -> ImageFramer:
        key = json.dumps(list(tools or ()), sort_keys=True, default=str)
        framer = self._framers.get(key)
        if framer is None:
            kwargs = {**self._template, **({"tools": list(tools)} if tools else {})}
            chat = ChatFramer(self.backend.tokenizer, chat_template_kwargs=kwargs)
            framer = self._framers[key] = ImageFramer(self.processor, chat)
        return framer


def shown_images(backend: Any, raw: Sequence[Any]) -> list[Any]:
    """The images of one env reply, decoded, for ``backend``'s model to see.

    Args:
        backend: The evaluation's backend.
        raw: The reply's image values (PIL images, PNG bytes, base64...).

    Raises:
        ImageObservationError: the policy is text-only, or an image does not decode: the
            episode fails, the run goes on.
        EvaluationError: ``backend`` cannot take images at all: the run stops.
    """
    count = image_count(len(raw))
    name = type(backend).__name__
    if not getattr(backend, "shows_images", False):
        supports = getattr(backend, "supports_images", None)
        if supports is False:
            raise ImageObservationError(
                f"the env sent {count} but the policy is text-only ({name}'s model has no "
                "vision part): evaluate a vision-language model, or an env that sends text only"
            )
        if supports:
            raise EvaluationError(
                f"the env sent {count}, and {name} holds a vision-language model but no "
                "processor to frame images with: generate through ImageChatBackend(backend, "
                "load_processor(model_dir)) (agile-llmenvs eval does so for backend: huggingface)"
            )
        raise EvaluationError(
            f"the env sent {count}, but {name} cannot show images to its model (it sends a "
            "conversation's text alone): evaluate a vision-language model with backend: "
            "huggingface, which frames the images with the model's processor"
        )
    return [
        decode_image(value, where=f"observation image {i + 1} of {len(raw)}")
        for i, value in enumerate(raw)
    ]
