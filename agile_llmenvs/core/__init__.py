"""The state-passing environment face, and its one adapter from :class:`TextEnv`.

Runners and branching drive :class:`Environment`: ``reset`` returns a :class:`State`, and
``step(state, action)`` a :class:`StepResult` holding the next one. :func:`from_text_env`
turns any ``TextEnv`` (or a factory of them) into one.
"""

from __future__ import annotations

from agile_llmenvs.core.images import ImagePrompt, SampleImages, image_model_inputs
from agile_llmenvs.core.text_env import TextEnvironment, from_text_env, render_action
from agile_llmenvs.core.types import Action, Environment, EnvironmentSpec, State, StepResult

__all__ = [
    "Action",
    "Environment",
    "EnvironmentSpec",
    "ImagePrompt",
    "SampleImages",
    "State",
    "StepResult",
    "TextEnvironment",
    "from_text_env",
    "image_model_inputs",
    "render_action",
]
