"""The package's cache folder: built models and generated games live under it."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """``$AGILE_LLMENVS_CACHE`` if that variable is set and non-empty, else
    ``~/.cache/agile_llmenvs``."""
    root = os.environ.get("AGILE_LLMENVS_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "agile_llmenvs"
