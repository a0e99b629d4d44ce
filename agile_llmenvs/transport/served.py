"""ServedEnv: what an env server serves, as one value (as httpx's ``Timeout`` and ``Limits``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeAlias

__all__ = ["DEFAULT_MAX_SESSIONS", "EnvLike", "ServedEnv"]

#: Sessions a server with ``make_env`` serves at once unless told otherwise.
DEFAULT_MAX_SESSIONS = 256

EnvLike: TypeAlias = Any
"""A :class:`~agile_llmenvs.core.TextEnv` or an OpenEnv ``Environment`` (OpenEnv's classes
are untyped)."""


@dataclass(frozen=True)
class ServedEnv:
    """What an env server serves: one shared env or a factory, its name, how many at once,
    the token clients present, and the env's wire classes.

    :class:`~agile_llmenvs.transport.server.OpenEnvServer` and
    :func:`~agile_llmenvs.transport.asgi.create_asgi_app` take these as keywords, or one
    ``ServedEnv`` in their place: ``OpenEnvServer(ServedEnv(make_env=MyEnv,
    max_concurrent_envs=8), port=0)``.

    Attributes:
        env: A single shared local env (one session at a time). Exactly one of ``env`` /
            ``make_env``.
        make_env: Zero-argument factory building a fresh env per session.
        env_name: Name in the env's metadata; defaults to its class name.
        max_concurrent_envs: Max live sessions (with ``make_env``; default
            :data:`DEFAULT_MAX_SESSIONS`; None: unlimited).
        token: Shared secret clients must present; an empty one is refused.
        action_cls: The env's action class, as ``create_app`` takes it. Default: the env's
            ``step`` annotation (``ACTION_CLS`` if it sets one), else OpenEnv's ``Action``.
        observation_cls: The env's observation class (default: ``step``'s return annotation).
        state_cls: The env's state class (default: the ``state`` property's annotation).
    """

    env: EnvLike | None = None
    make_env: Callable[[], EnvLike] | None = None
    env_name: str | None = None
    max_concurrent_envs: int | None = DEFAULT_MAX_SESSIONS
    token: str | None = None
    action_cls: type | None = None
    observation_cls: type | None = None
    state_cls: type | None = None

    @classmethod
    def of(cls, env: EnvLike | ServedEnv | None = None, /, **keywords: Any) -> ServedEnv:
        """``env`` when it is a ``ServedEnv`` already, else the value ``env`` and the
        ``keywords`` (the other fields, by name) make.

        Raises:
            ValueError: ``env`` is a ``ServedEnv`` and a keyword differs from its default
                too (the settings would be given twice).
        """
        if not isinstance(env, ServedEnv):
            return cls(env, **keywords)
        default = cls()
        twice = sorted(name for name, value in keywords.items() if value != getattr(default, name))
        if twice:
            raise ValueError(
                f"{', '.join(twice)} given both in the ServedEnv and as keywords; pass them in "
                "one place"
            )
        return env

    def checked(self, owner: str) -> ServedEnv:
        """This value checked, a shared env's capacity set to its one session; ``owner``
        names the caller in errors.

        Raises:
            ValueError: both or neither of ``env``/``make_env``, ``max_concurrent_envs > 1``
                with a shared ``env``, or ``max_concurrent_envs < 1``.
        """
        if (self.env is None) == (self.make_env is None):
            raise ValueError(f"{owner} needs exactly one of `env` or `make_env`")
        capacity = self.max_concurrent_envs
        if self.env is not None and capacity == DEFAULT_MAX_SESSIONS:
            capacity = 1
        if self.env is not None and capacity not in (None, 1):
            raise ValueError(
                f"max_concurrent_envs={capacity} needs `make_env`: one shared `env` "
                "serves one session at a time"
            )
        if capacity is not None and capacity < 1:
            raise ValueError(f"max_concurrent_envs must be >= 1, got {capacity}")
        return replace(self, max_concurrent_envs=1 if self.env is not None else capacity)

    def given_types(self) -> dict[str, type]:
        """The wire classes given (``action_cls`` and the like), by field name: they win over
        what an env's annotations say."""
        names = ("action_cls", "observation_cls", "state_cls")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}
