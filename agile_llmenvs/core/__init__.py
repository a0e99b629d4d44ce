"""The vocabulary at the bottom of the package, and the state-passing environment face.

The text-env contract an environment author writes (:class:`TextEnv`, with its narrow
optional protocols), the chat messages and completions every layer speaks, and the records
of an episode (:class:`EpisodeData`, :class:`Trajectory`, ...) live here and import nothing
above. Runners and branching drive :class:`Environment`: ``reset`` returns a :class:`State`,
and ``step(state, action)`` a :class:`StepResult` holding the next one.
:func:`from_text_env` turns any ``TextEnv`` (or a factory of them) into one.
"""

from __future__ import annotations

from agile_llmenvs.core.chat import (
    Completion,
    FinishReason,
    Generation,
    Message,
    Messages,
    ToolCall,
    Tools,
)
from agile_llmenvs.core.contract import (
    StepTuple,
    SupportsDatasetSize,
    SupportsMaxTurns,
    SupportsSnapshot,
    SupportsTools,
    TextEnv,
)
from agile_llmenvs.core.episode import EpisodeData, StopReason, Task, TokenSample, TurnResult
from agile_llmenvs.core.images import ImagePrompt, SampleImages, image_model_inputs
from agile_llmenvs.core.text_env import TextEnvironment, from_text_env, render_action
from agile_llmenvs.core.trajectory import (
    RolloutBatch,
    Trajectory,
    failed_episode,
    finished_rewards,
)
from agile_llmenvs.core.types import Action, Environment, EnvironmentSpec, State, StepResult

__all__ = [
    "Action",
    "Completion",
    "Environment",
    "EnvironmentSpec",
    "EpisodeData",
    "FinishReason",
    "Generation",
    "ImagePrompt",
    "Message",
    "Messages",
    "RolloutBatch",
    "SampleImages",
    "State",
    "StepResult",
    "StepTuple",
    "StopReason",
    "SupportsDatasetSize",
    "SupportsMaxTurns",
    "SupportsSnapshot",
    "SupportsTools",
    "Task",
    "TextEnv",
    "TextEnvironment",
    "TokenSample",
    "ToolCall",
    "Tools",
    "Trajectory",
    "TurnResult",
    "failed_episode",
    "finished_rewards",
    "from_text_env",
    "image_model_inputs",
    "render_action",
]
