"""A run's training settings, as the loops read them from its manifest."""

from __future__ import annotations

from agile_llmenvs.errors import AgileLLMEnvsError
from agile_llmenvs.specs import RunManifest, TrainingSpec

__all__ = ["training_spec"]


def training_spec(manifest: RunManifest) -> TrainingSpec:
    """The manifest's training section.

    Raises:
        AgileLLMEnvsError: the manifest has none.
    """
    if manifest.training is None:
        raise AgileLLMEnvsError("the manifest has no `training` section: add one to train")
    return manifest.training
