"""Other libraries' progress bars and chatter, off for a while.

``transformers`` ("Loading weights", "Writing model shards"), ``huggingface_hub`` and
``datasets`` ("Generating train split") draw bars on stderr for work this package shows its
own way (or not at all). Each context turns a library's bars and below-error logs off and
restores the library's settings after it, so a caller's own choice outlives it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["quiet_datasets", "quiet_libraries", "quiet_transformers"]


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """``transformers``' and ``huggingface_hub``'s bars and below-error logs off."""
    import huggingface_hub.utils as hub
    from transformers.utils import logging as transformers_logging

    hub_bars = not hub.are_progress_bars_disabled()
    transformers_bars = transformers_logging.is_progress_bar_enabled()
    transformers_level = transformers_logging.get_verbosity()
    transformers_logging.disable_progress_bar()  # hub's bars too
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(transformers_level)
        if transformers_bars:
            transformers_logging.enable_progress_bar()
        if hub_bars:
            hub.enable_progress_bars()
        else:
            hub.disable_progress_bars()


@contextmanager
def quiet_datasets() -> Iterator[None]:
    """``datasets``' bars and below-error logs off (nothing to do when it is not installed)."""
    try:
        from datasets.utils import (
            are_progress_bars_disabled,
            disable_progress_bars,
            enable_progress_bars,
        )
        from datasets.utils import logging as datasets_logging
    except ImportError:
        yield
        return
    bars = not are_progress_bars_disabled()
    level = datasets_logging.get_verbosity()
    disable_progress_bars()
    datasets_logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets_logging.set_verbosity(level)
        if bars:
            enable_progress_bars()


@contextmanager
def quiet_libraries() -> Iterator[None]:
    """Both of the above."""
    with quiet_transformers(), quiet_datasets():
        yield
