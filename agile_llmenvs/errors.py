"""Every error agile_llmenvs raises on purpose derives from one root class.

Messages say what was expected, what came, and how to fix it. Bad manifests are the one
exception to the rule: they fail at load with pydantic's ``ValidationError`` naming the field,
because that is what editors, CLIs and users of pydantic already understand.
"""

from __future__ import annotations

__all__ = [
    "AgileLLMEnvsError",
    "EnvBuildError",
    "ImportPathError",
    "ManifestError",
    "OptionalDependencyError",
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
        super().__init__(f"The package {package!r} is needed{what} but is not installed; run: {hint}")
        self.package = package
        self.extra = extra
