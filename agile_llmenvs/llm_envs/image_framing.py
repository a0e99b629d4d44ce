"""Framing with images: the processor's own ids for a conversation whose messages show images.

A message shows images as content parts, ``[{"type": "image", "image": <PIL image>}, ...,
{"type": "text", "text": ...}]``, the form Hugging Face processors' chat templates render. The
template (the processor's, through :class:`~agile_llmenvs.llm_envs.framing.ChatFramer`) puts
its placeholder where each image goes; the processor then tokenizes that text with the images,
expanding each placeholder into the image's tokens exactly as it does for the model, and
returns the pixel tensors. A turn appended after a sampled completion is the same text the
text path appends, tokenized by the processor with that turn's images only: a processor
treats images independently, so the sample's tensors are each turn's concatenated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agile_llmenvs.core.images import TOKEN_ALIGNED_KEYS, SampleImages
from agile_llmenvs.llm_envs.framing import ChatFramer
from agile_llmenvs.transport.images import (
    IMAGES_FIELD,
    ImageObservationError,
    decode_image,
    image_count,
    reply_images,
)
from agile_llmenvs.transport.types import EnvReply

__all__ = ["ImageFramer", "PromptRenderer", "content_text", "message_images", "with_images"]

Message = Mapping[str, Any]


def message_images(messages: Sequence[Message]) -> list[Any]:
    """The images the messages show, in order."""
    return [
        part["image"]
        for message in messages
        if not isinstance(message.get("content"), str)
        for part in message.get("content") or ()
        if isinstance(part, Mapping) and part.get("type") == "image"
    ]


def content_text(content: Any) -> str:
    """A message content's text: the string, or the text parts of a content with images."""
    if isinstance(content, str):
        return content
    return "".join(str(part.get("text", "")) for part in content if part.get("type") == "text")


def with_images(content: str, images: Sequence[Any]) -> str | list[dict[str, Any]]:
    """A message content showing ``images`` before ``content`` (the text alone if none)."""
    if not images:
        return content
    parts: list[dict[str, Any]] = [{"type": "image", "image": image} for image in images]
    return [*parts, {"type": "text", "text": content}]


class ImageFramer:
    """Ids and image tensors of conversations with images, from a Hugging Face processor.

    Args:
        processor: The vision-language model's processor (``AutoProcessor``): called as
            ``processor(text=[...], images=[...])``, with an ``image_token``.
        framer: The harness's framer; it renders with the processor's chat template.
    """

    def __init__(self, processor: Any, framer: ChatFramer) -> None:
        self.processor = processor
        self.framer = framer
        tokenizer = getattr(processor, "tokenizer", None) or framer.tokenizer
        token = getattr(processor, "image_token", None)
        if token is None:
            raise TypeError(
                f"vision_processor {type(processor).__name__} has no image_token: pass the "
                "vision-language model's processor (AutoProcessor.from_pretrained)"
            )
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(token))

    def prompt(self, messages: Sequence[Message]) -> tuple[list[int], SampleImages]:
        """The ids of ``messages`` with the generation prompt, and their images."""
        text = self.framer.render(messages, generation=True)
        return self._encode(text, message_images(messages), continuation=False)

    def turn(
        self,
        completion_ids: Sequence[int],
        observations: Sequence[Message],
        *,
        system: bool = False,
    ) -> tuple[list[int], SampleImages] | None:
        """What :meth:`ChatFramer.turn_ids` appends, for observations that show images."""
        parts = self.framer.turn_text(completion_ids, observations, system=system)
        if parts is None:
            return None
        text, skip = parts
        ids, images = self._encode(text, message_images(observations), continuation=True)
        return ids[skip:], images

    def _encode(
        self, text: str, images: Sequence[Any], *, continuation: bool
    ) -> tuple[list[int], SampleImages]:
        anchor = self.framer._anchor if continuation else None
        if anchor is not None:
            text = anchor[0] + text
        out = self.processor(
            text=[text], images=list(images) or None, add_special_tokens=False, return_tensors="pt"
        )
        ids = [int(i) for i in out["input_ids"][0].tolist()]
        if anchor is not None:
            if ids[:1] != [anchor[1]]:
                raise ValueError(
                    f"the processor did not keep the anchor token {anchor[0]!r} whole; its "
                    "tokenizer splits special tokens"
                )
            ids = ids[1:]
        if not images:
            return ids, SampleImages()
        tensors = {k: v for k, v in out.items() if k not in TOKEN_ALIGNED_KEYS}
        return ids, SampleImages(tuple(images), tensors, ids.count(self.image_token_id))


class PromptRenderer:
    """What a harness's policy is shown: prompts and turns as ids with the images they show.

    Conversations that show images go through an :class:`ImageFramer`; all others through
    the text framer alone, so a text policy pays nothing for images it never sees.

    Args:
        framer: The harness's framer.
        processor: The vision-language model's processor; None: the policy is text-only.
        max_images: ``segment_max_images``: the most images one observation may show.
        image_field: The observation field holding the images (None: the observation's
            ``images``, else ``info["images"]``).
    """

    def __init__(
        self,
        framer: ChatFramer,
        processor: Any = None,
        *,
        max_images: int | None = None,
        image_field: str | None = None,
    ) -> None:
        self.framer = framer
        self.image_framer = ImageFramer(processor, framer) if processor is not None else None
        self.max_images, self.image_field = max_images, image_field

    def prompt(self, messages: Sequence[Message]) -> tuple[list[int], SampleImages]:
        """A prompt's ids and the images it shows (the processor's, when it shows any)."""
        if self.image_framer is not None and message_images(messages):
            return self.image_framer.prompt(messages)
        return self.framer.prompt(messages), SampleImages()

    def turn(
        self, completion_ids: Sequence[int], observations: Sequence[Message], *, system: bool
    ) -> tuple[list[int], SampleImages] | None:
        """The ids (and images) appended after a completion; None: re-render the whole."""
        if self.image_framer is not None and message_images(observations):
            return self.image_framer.turn(completion_ids, observations, system=system)
        ids = self.framer.turn_ids(completion_ids, observations, system=system)
        return None if ids is None else (ids, SampleImages())

    def images(self, reply: EnvReply) -> list[Any]:
        """The reply's images, decoded, for the policy to see (none: an empty list).

        Raises:
            ImageObservationError: an image does not decode, there are more than
                ``max_images``, or the policy is text-only (no processor).
        """
        raw = reply_images(reply.observation, reply.metadata, self.image_field)
        if not raw:
            return []
        count = image_count(len(raw))
        if self.image_framer is None:
            raise ImageObservationError(
                f"the env sent {count} but the policy is text-only (the harness has no "
                "vision_processor): use a vision-language model (its processor as "
                "vision_processor), or an env that sends text only"
            )
        if self.max_images is not None and len(raw) > self.max_images:
            raise ImageObservationError(
                f"the env sent {count} in one observation, more than segment_max_images="
                f"{self.max_images}: raise segment_max_images, or send fewer images per "
                "observation"
            )
        return [
            decode_image(value, where=f"observation image {i + 1} of {len(raw)}")
            for i, value in enumerate(raw)
        ]

    def env_info(self, reply: EnvReply) -> dict[str, Any]:
        """The env's info without the images it carries (they go to the policy)."""
        info = dict(reply.metadata)
        if self.image_field is None:
            info.pop(IMAGES_FIELD, None)
        return info
