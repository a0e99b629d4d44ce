"""Envs that show images, for the image-path tests (importable by path for servers)."""

from __future__ import annotations

from typing import Any


def square(colour: tuple[int, int, int], width: int = 56, height: int = 56) -> Any:
    """A solid-colour RGB PIL image."""
    from PIL import Image

    return Image.new("RGB", (width, height), colour)


class PictureEnv:
    """Shows ``images[t]`` (a list of image values) with the observation of turn ``t``;
    ends after ``turns`` steps. ``text`` is the observation text of every turn."""

    def __init__(self, images: list[list[Any]], turns: int = 3, text: str = "look") -> None:
        self.images, self.turns, self.text = images, turns, text
        self.turn = 0

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        self.turn = 0
        return f"{self.text} 0", {"images": self.images[0], "seed": seed}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        done = self.turn >= self.turns
        images = [] if done else self.images[self.turn]
        return f"{self.text} {self.turn}", 1.0, done, False, {"images": images}

    def close(self) -> None:
        pass
