"""Images in observations: what an env may send, and how they travel on the OpenEnv wire.

An env shows the policy images beside its text: a ``TextEnv`` puts them in ``info["images"]``
(or a declared observation field); on the wire they are the observation's ``images`` field, a
list of base64 PNG strings. An image value is any of: a PIL image, PNG / JPEG / ... bytes,
such bytes as base64 (or a ``data:image/...;base64,`` URL), or a ``H x W x 3`` uint8 array.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Mapping, Sequence
from typing import Any

from agile_llmenvs.errors import AgileLLMEnvsError

__all__ = [
    "IMAGES_FIELD",
    "ImageObservationError",
    "decode_image",
    "encode_image",
    "image_count",
    "image_values",
    "reply_images",
]

#: The observation (and ``info``) field that carries an observation's images.
IMAGES_FIELD = "images"
_HOW = (
    "send a PIL image, PNG or JPEG bytes, those bytes as base64 (or a data:image/...;base64, "
    "URL), or an H x W x 3 uint8 array"
)


class ImageObservationError(AgileLLMEnvsError, ValueError):
    """An observation's images cannot be shown to the policy: one does not decode, there are
    more than the harness allows, or the policy is text-only."""


def decode_image(value: Any, *, where: str = "image") -> Any:
    """``value`` as an RGB PIL image.

    Args:
        value: An image value (see the module docstring).
        where: Names the value in the error (``"observation image 2 of 3"``).

    Raises:
        ImageObservationError: ``value`` is none of those, or does not decode.
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB") if value.mode != "RGB" else value
    if isinstance(value, str):
        text = value.split(",", 1)[1] if value.startswith("data:") else value
        try:
            value = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageObservationError(
                f"{where} is a string that is not base64 ({exc}); {_HOW}"
            ) from exc
    if isinstance(value, bytes | bytearray | memoryview):
        try:
            with Image.open(io.BytesIO(bytes(value))) as image:
                return image.convert("RGB")
        except UnidentifiedImageError as exc:  # PIL's text adds only a BytesIO's address
            raise ImageObservationError(
                f"{where} could not be decoded ({len(value)} bytes that are no image format "
                f"PIL reads: cannot identify image file); {_HOW}"
            ) from exc
        except (OSError, ValueError) as exc:  # a known format, but damaged
            raise ImageObservationError(
                f"{where} could not be decoded ({len(value)} bytes: {exc}); {_HOW}"
            ) from exc
    if hasattr(value, "__array__"):
        import numpy as np

        array = np.asarray(value)
        if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
            raise ImageObservationError(
                f"{where} is an array of shape {array.shape} and dtype {array.dtype}, not "
                f"H x W x 3 uint8; {_HOW}"
            )
        return Image.fromarray(array, mode="RGB")
    raise ImageObservationError(f"{where} is a {type(value).__name__}; {_HOW}")


def encode_image(value: Any, *, where: str = "image") -> str:
    """``value`` (any image value) as a base64 PNG string, the wire's form.

    Raises:
        ImageObservationError: as :func:`decode_image`, ``where`` naming the value.
    """
    image = decode_image(value, where=where)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def image_values(value: Any) -> list[Any]:
    """The raw image values a field holds, in order: none for None, one for a single value
    (a string, bytes, an image or an array), else the sequence's items."""
    if value is None:
        return []
    if isinstance(value, str | bytes | bytearray) or not isinstance(value, Sequence):
        return [value]
    return list(value)


def image_count(count: int) -> str:
    """``"1 image"``, ``"3 images"``: how errors count images."""
    return f"{count} image{'' if count == 1 else 's'}"


def reply_images(
    observation: Mapping[str, Any], metadata: Mapping[str, Any], field: str | None = None
) -> list[Any]:
    """The raw image values of one env reply, in order (not decoded).

    ``field`` names the observation field that holds them; unset, the observation's
    ``images``, else ``info["images"]`` (an in-process env's). A single value is one image.

    Raises:
        ImageObservationError: ``field`` is set but the observation has no such field.
    """
    if field is not None:
        if field not in observation:
            raise ImageObservationError(
                f"image_field {field!r} is not in the observation; it has {sorted(observation)}"
            )
        value = observation[field]
    else:
        value = observation.get(IMAGES_FIELD)
        if value is None:
            value = metadata.get(IMAGES_FIELD)
    return image_values(value)
