"""GEM envs (``gem-llm``, the ``envs`` extra) as text envs: ``factory: gem:make`` or this
module's :func:`make` with a registry id such as ``game:GuessTheNumber-v0-easy``.

GEM's word games (Wordle, Hangman, WordSearch) read the NLTK ``words`` corpus, and Wordle and
Hangman call ``nltk.download`` in every constructor. :func:`make` checks the corpus first
(:func:`check_nltk_corpora`), so a missing one is a one-line
:class:`~agile_llmenvs.errors.EnvBuildError` at build time naming the fix, and with the corpus
installed their download call is skipped: building an env never reaches the network. A
manifest's ``factory: gem:make`` (GEM's own) is built by :func:`make` too
(:func:`checked_factory`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from agile_llmenvs.errors import EnvBuildError, OptionalDependencyError

__all__ = [
    "GemTextEnv",
    "check_nltk_corpora",
    "checked_factory",
    "make",
    "nltk_corpora_needed",
]

NLTK_CORPORA: dict[str, tuple[str, ...]] = {
    "gem.envs.game_env.wordle": ("words",),
    "gem.envs.game_env.hangman": ("words",),
    "gem.envs.game_env.word_search": ("words",),
}
"""The NLTK corpora GEM's env modules load when an env is built, by module."""

_NLTK_DOWNLOAD = threading.Lock()  # guards the swap of ``nltk.download``


class GemTextEnv:
    """A GEM env behind the :class:`~agile_llmenvs.llm_envs.TextEnv` contract.

    GEM envs are already gymnasium-shaped with string observations; this forwards them,
    drops reset kwargs GEM does not take (a collector's ``row_index``), and exposes the env's
    own ``max_turns`` so the harness's turn budget can be probed from it.
    """

    def __init__(self, env: Any) -> None:
        self.env = env
        self.max_turns = int(getattr(env, "max_turns", 0) or 0) or None

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        """Start a game (``seed`` picks it)."""
        observation, info = self.env.reset(seed=seed)
        return str(observation), dict(info or {})

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Play the policy's text."""
        observation, reward, terminated, truncated, info = self.env.step(action)
        return str(observation), float(reward), bool(terminated), bool(truncated), dict(info)

    def close(self) -> None:
        """Close the GEM env."""
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


def make(env_id: str, **kwargs: Any) -> GemTextEnv:
    """Build GEM env ``env_id`` as a text env.

    Raises:
        OptionalDependencyError: ``gem-llm``, or a package the env imports (``pylatexenc``
            for the math envs), is not installed.
        EnvBuildError: GEM has no env ``env_id`` (or refuses ``kwargs``), or the env needs an
            NLTK corpus that is not installed.
    """
    try:
        import gem
    except ImportError as exc:
        raise OptionalDependencyError(
            "gem-llm", extra="envs", feature=f"GEM env {env_id!r}"
        ) from exc
    corpora = check_nltk_corpora(env_id)
    try:
        with _nltk_downloads_skipped(corpora):
            return GemTextEnv(gem.make(env_id, **kwargs))
    except ImportError as exc:
        missing = _missing_module(exc)
        if missing is None:
            raise EnvBuildError(f"GEM could not build {env_id!r}: ImportError: {exc}") from exc
        raise OptionalDependencyError(missing, extra="envs", feature=f"GEM env {env_id!r}") from exc
    except Exception as exc:
        raise EnvBuildError(f"GEM could not build {env_id!r}: {type(exc).__name__}: {exc}") from exc


def checked_factory(factory: Callable[..., Any]) -> Callable[..., Any]:
    """``factory``, or :func:`make` in place of GEM's own ``gem.make`` (what a manifest's
    ``factory: gem:make`` loads), so that the NLTK corpus check and the skipped download apply
    on that path too. Call it on every loaded ``factory:`` entrypoint; it imports nothing."""
    gem = sys.modules.get("gem")
    if gem is not None and factory is getattr(gem, "make", None):
        return make
    return factory


def check_nltk_corpora(env_id: str) -> tuple[str, ...]:
    """The NLTK corpora GEM env ``env_id`` loads when built, checked to be installed (where
    ``NLTK_DATA`` and NLTK's default folders lead), without trying to download one.

    Raises:
        EnvBuildError: one is not installed; the one-line message names the fix.
    """
    corpora = nltk_corpora_needed(env_id)
    for corpus in corpora:
        _require_nltk_corpus(env_id, corpus)
    return corpora


def nltk_corpora_needed(env_id: str) -> tuple[str, ...]:
    """The NLTK corpora GEM env ``env_id`` loads when built (none for an unknown id)."""
    from gem.envs.registration import ENV_REGISTRY

    spec = ENV_REGISTRY.get(env_id)
    if spec is None:
        return ()
    entry_point = spec.entry_point
    module = (
        entry_point.split(":")[0]
        if isinstance(entry_point, str)
        else getattr(entry_point, "__module__", "")
    )
    return NLTK_CORPORA.get(module, ())


def _missing_module(exc: BaseException) -> str | None:
    """The top-level module whose absence caused ``exc`` (GEM re-raises the import error of
    an env's module as a plain ``ImportError``, the original in its context)."""
    cause: BaseException | None = exc
    while cause is not None:
        top = (getattr(cause, "name", None) or "").split(".")[0]
        if isinstance(cause, ImportError) and top and top != "gem":
            return top
        cause = cause.__cause__ or cause.__context__
    return None


def _require_nltk_corpus(env_id: str, corpus: str) -> None:
    import nltk

    try:
        nltk.data.find(f"corpora/{corpus}")
    except LookupError:
        raise EnvBuildError(
            f"{env_id} needs the NLTK corpus {corpus!r}, which is not installed: run python -m "
            f"nltk.downloader {corpus}, or set NLTK_DATA to a folder that holds it"
        ) from None


@contextmanager
def _nltk_downloads_skipped(present: tuple[str, ...]) -> Iterator[None]:
    """Inside: ``nltk.download`` of a corpus in ``present`` (found installed) returns at once
    instead of fetching NLTK's index over the network; anything else downloads as before."""
    if not present:
        yield
        return
    import nltk

    with _NLTK_DOWNLOAD:
        original = nltk.download

        def download(info_or_id: Any = None, *args: Any, **kwargs: Any) -> Any:
            if info_or_id in present:
                return True
            return original(info_or_id, *args, **kwargs)

        nltk.download = download
        try:
            yield
        finally:
            nltk.download = original
