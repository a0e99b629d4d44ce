"""Every error agile_llmenvs raises on purpose derives from one root class.

Messages say what was expected, what came, and how to fix it. Bad manifests are the one
exception to the rule: they fail at load with pydantic's ``ValidationError`` naming the field,
because that is what editors, CLIs and users of pydantic already understand.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AgileLLMEnvsError",
    "BenchError",
    "BranchError",
    "CheckpointError",
    "ContinuationPromptError",
    "EnvAuthError",
    "EnvBuildError",
    "EnvCapacityError",
    "EnvConnectionError",
    "EnvError",
    "EnvExecutionError",
    "EnvFactoryError",
    "EnvFailuresError",
    "EnvHostError",
    "EnvProtocolError",
    "EnvStateError",
    "EnvTimeoutError",
    "GenerationServerError",
    "GenerationTimeoutError",
    "ImportPathError",
    "LoRASyncError",
    "LogitTransformError",
    "ManifestError",
    "NonFiniteUpdateError",
    "OptionalDependencyError",
    "ReplayError",
    "SlotTimeoutError",
    "StaleEpisodeError",
    "StaleStateError",
    "SyncCheckError",
    "TaskMismatchError",
    "TaskSelectionError",
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
    """An env call failed; ``code`` is the wire error code when the server sent one, and
    ``field_errors`` the invalid fields of the message it refused (pydantic's error list:
    ``loc``, ``msg``, ...), when it named them."""

    code: str = "EXECUTION_ERROR"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        field_errors: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.field_errors = field_errors


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


class GenerationServerError(BackendError):
    """A generation server (a running ``vllm serve``) failed a request: it refused it,
    answered with an error, or could not be reached (it died, or never started).

    Only the requests sent to that server fail; ``url`` names it.
    """

    def __init__(self, message: str, *, url: str, status_code: int | None = None) -> None:
        super().__init__(message, status_code=status_code)
        self.url = url


class GenerationTimeoutError(GenerationServerError, TimeoutError):
    """A generation server did not answer a request within the backend's ``timeout_s``."""


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


class BranchError(AgileLLMEnvsError, ValueError):
    """A checkpoint or branch that cannot be made: an unknown name, a strategy that does not
    fit the env, a replay that diverged, or a released manager."""


class BenchError(AgileLLMEnvsError, RuntimeError):
    """A benchmark script failed, printed no JSON result, or was asked for by a wrong name."""


class TaskSelectionError(AgileLLMEnvsError, ValueError):
    """Reset options did not select one task: an unknown or conflicting key, or no such task."""


class ReplayError(AgileLLMEnvsError, RuntimeError):
    """Replaying an episode's recorded actions did not reach the recorded state (the env is
    not deterministic given its seed and task, or the actions were not the ones taken)."""


class TaskMismatchError(ReplayError):
    """The task at a state's index is not the state's task: the task list changed since."""


class ContinuationPromptError(ReplayError):
    """A replayed command would leave the shell waiting for more input (a continuation prompt)."""


class EnvHostError(EnvConnectionError):
    """An env host (a Ray actor serving env sessions) died or cannot be reached: the episodes
    it carried are over, and new sessions go to the healthy hosts while Ray restarts it."""

    code = "HOST_LOST"


class LogitTransformError(AgileLLMEnvsError, TypeError):
    """A model's forward changes its output layer's logits in a way the scored-token path
    cannot reproduce (it would train on other log-probs than the sampler's)."""


class LoRASyncError(AgileLLMEnvsError, ValueError):
    """A LoRA policy's adapters cannot reach a vLLM sampler exactly (an adapter on a tied
    embedding or output layer, on a layer kind a sync cannot merge, or one an adapters-only
    sync cannot send): refused before anything is sent, the module named with the fix."""


class SyncCheckError(AgileLLMEnvsError, RuntimeError):
    """After a weight sync, the sampler's log-probs of a probe sequence differ from the
    policy's by more than ``training.sync_check_tolerance``: the sampler does not hold the
    policy being trained. The run stops (exit 2) rather than learn from another policy."""


class CheckpointError(AgileLLMEnvsError):
    """A run cannot resume (no checkpoint, or one saved by another setup), its folder is in
    use by another run, or its files could not be written (the disk full)."""


class NonFiniteUpdateError(AgileLLMEnvsError, FloatingPointError):
    """A learning step stopped before it changed a weight: the sampler recorded a log-prob no
    sampled token can have (non-finite, positive, or below ``-100``), or the step's gradient
    norm is not finite. The run ends with it (exit 2), its weights as they were."""


class EnvFailuresError(AgileLLMEnvsError, RuntimeError):
    """A run stopped because its env kept failing: ``training.max_failed_fraction`` of a
    step's episodes or more failed, ``training.max_failed_steps`` steps in a row."""
