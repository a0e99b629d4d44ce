"""Every error agile_llmenvs raises on purpose derives from one root class.

Messages say what was expected, what came, and how to fix it. Bad manifests are the one
exception to the rule: they fail at load with pydantic's ``ValidationError`` naming the field,
because that is what editors, CLIs and users of pydantic already understand.
"""

from __future__ import annotations

__all__ = [
    "AgileLLMEnvsError",
    "EnvAuthError",
    "EnvBuildError",
    "EnvCapacityError",
    "EnvConnectionError",
    "EnvError",
    "EnvExecutionError",
    "EnvFactoryError",
    "EnvProtocolError",
    "EnvStateError",
    "EnvTimeoutError",
    "ImportPathError",
    "ManifestError",
    "OptionalDependencyError",
    "SlotTimeoutError",
    "StaleEpisodeError",
    "StaleStateError",
]


class AgileLLMEnvsError(Exception):
    """Root of every error raised by agile_llmenvs."""


class ManifestError(AgileLLMEnvsError, ValueError):
    """A manifest file could not be read or parsed (before validation)."""


class ImportPathError(AgileLLMEnvsError, ImportError):
    """A ``module:attr`` path in a manifest does not resolve to an object."""


class EnvBuildError(AgileLLMEnvsError, RuntimeError):
    """A valid spec could not be turned into a live environment."""


class OptionalDependencyError(AgileLLMEnvsError, ImportError):
    """A feature needs an optional package that is not installed."""

    def __init__(self, package: str, *, extra: str | None = None, feature: str = "") -> None:
        hint = f'pip install "agile-llmenvs[{extra}]"' if extra else f"pip install {package}"
        what = f" for {feature}" if feature else ""
        super().__init__(
            f"The package {package!r} is needed{what} but is not installed; run: {hint}"
        )
        self.package = package
        self.extra = extra


# --- env transport: server error codes map to these types on the client ------------------


class EnvError(AgileLLMEnvsError, RuntimeError):
    """An env call failed; ``code`` is the wire error code when the server sent one."""

    code: str = "EXECUTION_ERROR"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class EnvExecutionError(EnvError):
    """The env raised while handling reset/step/state; the session stays usable."""

    code = "EXECUTION_ERROR"


class EnvProtocolError(EnvError):
    """A message broke the wire protocol (bad JSON, unknown type, invalid fields, too big)."""

    code = "VALIDATION_ERROR"


class EnvCapacityError(EnvError):
    """The server already serves its ``max_concurrent_envs`` sessions."""

    code = "CAPACITY_REACHED"


class EnvFactoryError(EnvError):
    """The server could not build an env for the session."""

    code = "FACTORY_ERROR"


class EnvAuthError(EnvError):
    """The server refused the session: missing or wrong token."""

    code = "UNAUTHORIZED"


class EnvConnectionError(EnvError):
    """The session's connection failed or was lost; the episode it carried is over.

    A lost session is never silently replaced by a fresh env mid-episode: the next ``reset``
    reconnects.
    """

    code = "CONNECTION_LOST"


class EnvTimeoutError(EnvConnectionError, TimeoutError):
    """A reply did not arrive within the client's timeout; the session was dropped so a late
    reply can never answer a later call."""

    code = "TIMEOUT"


class BackendError(AgileLLMEnvsError, RuntimeError):
    """A generation backend failed: a request was refused, or it failed past its retries.

    ``status_code`` is the HTTP status of an API backend's last response, when there was one.
    """

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class EvaluationError(AgileLLMEnvsError, ValueError):
    """An evaluation run was asked for with arguments that cannot work together."""


class StaleStateError(AgileLLMEnvsError, ValueError):
    """A ``State`` was stepped that its environment has already moved past or released."""


class EnvStateError(EnvError):
    """A call made in the wrong lifecycle state (step before reset, after close, after done)."""

    code = "INVALID_STATE"


class StaleEpisodeError(EnvStateError):
    """A step for an episode that was finalized while its env round trip was in flight."""

    code = "STALE_EPISODE"


class SlotTimeoutError(AgileLLMEnvsError, TimeoutError):
    """No rollout slot became free within ``slot_acquire_timeout_s``."""
