"""NLTK data without the network, while an adapter builds an env.

TextArena's word games, verifiers' envs built on them and GEM's call ``nltk.download`` when
they are imported or built; offline that hangs on NLTK's index or prints an urlopen error,
and online it downloads data nobody asked for. Inside :func:`nltk_offline`, on the thread
that builds, ``nltk.download`` of data that is installed (where ``NLTK_DATA`` and NLTK's
default folders lead) returns at once, and of data that is not raises
:class:`~agile_llmenvs.errors.EnvBuildError` naming the fix. Outside it, and on other
threads, ``nltk.download`` is NLTK's own (a library that saved it while the guard was in
place still reaches NLTK's through it).
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from agile_llmenvs.errors import EnvBuildError

__all__ = ["nltk_installed", "nltk_offline"]

#: NLTK's data folders: where an id such as ``words`` or ``punkt`` may be found.
_CATEGORIES = (
    "corpora",
    "tokenizers",
    "taggers",
    "chunkers",
    "grammars",
    "misc",
    "sentiment",
    "stemmers",
    "models",
    "help",
)
_BUILDING = threading.local()  # .who: what this thread is building, inside the guard
_INSTALL = threading.Lock()


@contextmanager
def nltk_offline(who: str) -> Iterator[None]:
    """Inside, on this thread: ``nltk.download`` never reaches the network (nothing happens
    without ``nltk`` installed).

    Args:
        who: What is being built, for the message (``"TextArena game 'Wordle-v0'"``).
    """
    if "nltk" not in sys.modules and importlib.util.find_spec("nltk") is None:
        yield
        return
    _install()
    outer = getattr(_BUILDING, "who", None)
    _BUILDING.who = who
    try:
        yield
    finally:
        _BUILDING.who = outer


def nltk_installed(resource: str) -> bool:
    """Whether NLTK data ``resource`` (an id as ``nltk.download`` takes it: ``words``,
    ``averaged_perceptron_tagger_eng``) is installed, looked up without the network."""
    import nltk

    for category in _CATEGORIES:
        for name in (resource, f"{resource}.zip"):
            try:
                nltk.data.find(f"{category}/{name}")
            except LookupError:
                continue
            return True
    return False


def _install() -> None:
    """Put the guarded ``nltk.download`` in place once per process."""
    import nltk

    with _INSTALL:
        if getattr(nltk.download, "_agile_llmenvs_guard", False):
            return
        original = nltk.download

        def download(info_or_id: Any = None, *args: Any, **kwargs: Any) -> Any:
            who = getattr(_BUILDING, "who", None)
            if who is None:
                return original(info_or_id, *args, **kwargs)
            if isinstance(info_or_id, str) and nltk_installed(info_or_id):
                return True
            raise EnvBuildError(_missing(who, info_or_id))

        download._agile_llmenvs_guard = True  # type: ignore[attr-defined]
        nltk.download = download


def _missing(who: str, resource: Any) -> str:
    if not isinstance(resource, str):
        return (
            f"{who} asked NLTK to download data interactively ({resource!r}), which needs the "
            "network: install the data it needs first (python -m nltk.downloader ID)"
        )
    return (
        f"{who} needs the NLTK data {resource!r}, which is not installed: run python -m "
        f"nltk.downloader {resource}, or set NLTK_DATA to a folder that holds it"
    )
