"""Loading a verifiers env (0.3.x's or 0.4's) from a manifest's ``env_id``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agile_llmenvs.adapters._nltk import nltk_offline
from agile_llmenvs.errors import AgileLLMEnvsError, EnvBuildError

__all__ = ["load_verifiers_env"]


def load_verifiers_env(
    env_id: str,
    kwargs: dict[str, Any],
    env_class: type,
    *,
    installed: Callable[..., Any] | None = None,
) -> Any:
    """What ``env_id`` builds, without NLTK's downloader reaching the network: for an id
    without ``:``, ``installed(env_id, **kwargs)`` (``verifiers.load_environment``); for a
    ``module:attr``, the object there, called with ``kwargs`` unless it is an ``env_class``
    already.

    Raises:
        EnvBuildError: loading or building it raised (its type and message named).
    """
    try:
        with nltk_offline(f"verifiers env {env_id!r}"):
            if ":" not in env_id and installed is not None:
                return installed(env_id, **kwargs)
            from agile_llmenvs.transport.resolve import load_entrypoint

            found = load_entrypoint(env_id)
            building = callable(found) and not isinstance(found, env_class)
            return found(**kwargs) if building else found
    except AgileLLMEnvsError:
        raise
    except Exception as exc:
        raise EnvBuildError(
            f"verifiers could not load {env_id!r}: {type(exc).__name__}: {exc}"
        ) from exc
