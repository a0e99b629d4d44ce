"""The images a dataset row shows: its ``images`` cell, decoded and put in its prompt.

A row shows images through its ``images`` column (the spec's ``columns`` renames yours:
``{"images": "pictures"}``): a list of image values, each a PIL image (a ``datasets``
``Image`` feature), PNG / JPEG / ... bytes, those bytes as base64 (or a
``data:image/...;base64,`` URL), or an ``H x W x 3`` uint8 array; a single value is one image,
an empty list or null none. Given an ``image_root`` (``make_llm_env`` gives the dataset file's
folder), a string that names a file under it is that file's image: ``"pics/0.png"`` beside the
jsonl. The images are shown before the text of the prompt's first user message.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agile_llmenvs.llm_envs.image_framing import with_images
from agile_llmenvs.llm_envs.rows import DatasetError
from agile_llmenvs.transport.images import decode_image

__all__ = ["IMAGES_COLUMN", "decode_cell", "show_images"]

#: The column of a row's images.
IMAGES_COLUMN = "images"


def decode_cell(values: Sequence[Any], *, where: str, root: Path | None) -> list[Any]:
    """Each value as an RGB PIL image; a string naming a file under ``root`` is read from it.

    Raises:
        ImageObservationError: a value does not decode; the message names ``where`` and the
            image (``"train row 3 image 2 of 2"``).
    """
    images = []
    for i, value in enumerate(values):
        # os.path.isfile, not Path.is_file: a long base64 string is no path, and no error
        if isinstance(value, str) and root is not None and os.path.isfile(root / value):
            value = (root / value).read_bytes()
        images.append(decode_image(value, where=f"{where} image {i + 1} of {len(values)}"))
    return images


def show_images(
    messages: Sequence[Mapping[str, Any]], images: Sequence[Any], *, where: str
) -> list[dict[str, Any]]:
    """``messages`` with ``images`` shown before the text of the first user message.

    Raises:
        DatasetError: no user message has a string content to show them in.
    """
    shown = [dict(message) for message in messages]
    for message in shown:
        if message.get("role") == "user":
            content = message.get("content")
            if not isinstance(content, str):
                raise DatasetError(
                    f"{where}: its first user message's content is {type(content).__name__}, "
                    "not a string; the row's images are shown before that text, so give it as "
                    "a string"
                )
            message["content"] = with_images(content, images)
            return shown
    raise DatasetError(
        f"{where}: the prompt has no user message to show the row's images in; add one"
    )
