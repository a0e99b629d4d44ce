"""A visual task that ships with the package: name the colour of the square in the image.

The text never says the colour, so only a policy that reads the image can score above
chance: the image is the observation. Small enough that the built-in tiny vision-language
model learns it on CPU from reward alone (``manifests/grpo_colour_squares.yaml``).
"""

from __future__ import annotations

import random
import re
from typing import Any

__all__ = ["COLOURS", "ColourSquareEnv"]

#: The colours a square may have, and the digit that names each one.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 25, 25),
    "green": (25, 200, 25),
    "blue": (25, 25, 230),
}
_DIGIT = re.compile(r"\d")


class ColourSquareEnv:
    """One turn: an image of a coloured square on grey, and the question which colour it is.

    The policy answers with the colour's digit (``0`` red, ``1`` green, ``2`` blue: one token
    in any tokenizer, so a random policy sometimes says one); the reward is 1.0 when the
    first digit it writes is the square's, else 0.0. The seed picks the colour, the square's
    size and its place.

    Args:
        size: The image's side in pixels (56: four image tokens for the tiny VLM).
        colours: How many of :data:`COLOURS` are used (2 or 3).
    """

    max_turns = 1

    def __init__(self, size: int = 56, colours: int = 3) -> None:
        if size < 28:
            raise ValueError(f"size must be at least 28 pixels, got {size}")
        if colours not in (2, 3):
            raise ValueError(f"colours must be 2 or 3, got {colours}")
        self.size = size
        self.names = list(COLOURS)[:colours]
        self.colour = ""

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        from PIL import Image, ImageDraw

        rng = random.Random(seed)
        self.colour = rng.choice(self.names)
        side = rng.randint(self.size // 2, self.size - 4)
        left, top = rng.randint(0, self.size - side), rng.randint(0, self.size - side)
        image = Image.new("RGB", (self.size, self.size), (128, 128, 128))
        ImageDraw.Draw(image).rectangle(
            (left, top, left + side - 1, top + side - 1), fill=COLOURS[self.colour]
        )
        choices = ", ".join(f"{i} {name}" for i, name in enumerate(self.names))
        question = f"What colour is the square? Answer with its digit: {choices}."
        return question, {"images": [image], "colour": self.colour}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        digit = _DIGIT.search(action)
        answer = int(digit.group()) if digit else None
        correct = answer is not None and answer < len(self.names)
        correct = correct and self.names[answer] == self.colour  # type: ignore[index]
        info = {"colour": self.colour, "answer": answer}
        return "", 1.0 if correct else 0.0, True, False, info

    def close(self) -> None:
        pass
