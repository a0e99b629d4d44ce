"""The standard text interface both ways over OpenEnv, and the reply every client returns."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from agile_llmenvs.errors import EnvExecutionError, EnvProtocolError
from agile_llmenvs.transport._openenv import Action, Observation, State

__all__ = ["EnvReply", "TextAction", "TextObservation", "TextState"]

#: Fields every OpenEnv observation has; none of them is the observation's text.
_OPENENV_FIELDS = frozenset({"done", "reward", "metadata"})


class TextAction(Action):
    """OpenEnv action carrying the policy's generated text."""

    message: str = Field("", description="The policy's text.")


class TextObservation(Observation):
    """OpenEnv observation carrying the next prompt text and optional labels.

    ``truncated`` is declared because the wire has only ``done`` (no terminated/truncated
    split), so it can travel and rebuild gymnasium's 5-tuple. On reset the prompt is shown to
    the policy and the labels stay unset; on the terminal step ``question`` / ``answer`` are
    set so rubrics can score. ``images`` are what the env shows the policy beside the text
    (its ``info["images"]``), each a base64 PNG.
    """

    prompt: str = Field("", description="Text shown to the policy next.")
    truncated: bool = Field(False, description="The episode ended by a limit, not by the task.")
    question: Any = Field(None, description="The task's question (terminal step only).")
    answer: Any = Field(None, description="The task's reference answer (terminal step only).")
    images: list[str] = Field(
        default_factory=list, description="Images shown to the policy, each a base64 PNG."
    )


class TextState(State):
    """OpenEnv state of a text env: what a trainer needs to know about it."""

    dataset_size: int | None = Field(None, description="Rows of a dataset-backed env.")
    tools: list[dict[str, Any]] | None = Field(None, description="Tools the env offers.")
    max_turns: int | None = Field(None, description="The env's own turn budget.")
    rubric_components: dict[str, float | None] | None = Field(
        None, description="Last score of each named rubric component."
    )


@dataclass(frozen=True)
class EnvReply:
    """One env answer as every client returns it, in-process or remote.

    Attributes:
        observation: The observation's fields (``prompt``, ``truncated``, ``question``, ...;
            a remote env's images are its ``images``).
        reward: The step's reward (``None`` after reset).
        done: Whether the episode ended.
        metadata: The env's ``info``.
    """

    observation: dict[str, Any]
    reward: float | None = None
    done: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        """The observation's text, first match wins: ``prompt`` (a text env's observation,
        whose terminal step also carries string ``question`` / ``answer`` labels), the text of
        an MCP tool's result (or its error), the one string field of any other structured
        observation (OpenEnv's own ``done`` / ``reward`` / ``metadata`` aside), else the
        observation as JSON (no string field, or several: name one with
        ``observation_field``)."""
        observation = self.observation
        prompt = observation.get("prompt")
        if isinstance(prompt, str):
            return prompt
        if "tool_name" in observation:
            return _tool_text(observation)
        texts = [
            value
            for name, value in observation.items()
            if isinstance(value, str) and name not in _OPENENV_FIELDS
        ]
        return texts[0] if len(texts) == 1 else json.dumps(observation)

    def listed_tools(self) -> list[dict[str, Any]]:
        """The tools of a reply to OpenEnv's ``list_tools`` step (a ``ListToolsObservation``),
        each a dict with ``name``, ``description`` and ``input_schema``.

        Raises:
            EnvProtocolError: the reply is not a tool listing.
            EnvExecutionError: the env could not list its tools (OpenEnv reports that as an
                empty listing with an ``error`` in its metadata).
        """
        tools = self.observation.get("tools")
        if not isinstance(tools, list):
            raise EnvProtocolError(
                f"expected a list_tools reply with a `tools` list, got the fields "
                f"{sorted(self.observation)}"
            )
        if not tools and self.metadata.get("error"):
            raise EnvExecutionError(f"the env could not list its tools: {self.metadata['error']}")
        return [dict(tool) for tool in tools]

    @property
    def truncated(self) -> bool:
        """Whether the episode ended by a limit rather than by the task."""
        return bool(self.observation.get("truncated", False))

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> EnvReply:
        """Parse the ``data`` of an ``observation`` reply frame."""
        observation = dict(data.get("observation") or {})
        metadata = data.get("metadata") or observation.pop("metadata", None) or {}
        observation.pop("metadata", None)
        reward = data.get("reward")
        return cls(
            observation=observation,
            reward=None if reward is None else float(reward),
            done=bool(data.get("done", False)),
            metadata=dict(metadata),
        )


def _tool_text(observation: dict[str, Any]) -> str:
    """The text of an OpenEnv ``CallToolObservation``: its error, or its content's text."""
    error = observation.get("error")
    if error:
        return f"Error: {error.get('message', error) if isinstance(error, dict) else error}"
    result = observation.get("result")
    if isinstance(result, dict):
        texts = [c.get("text", "") for c in result.get("content") or [] if isinstance(c, dict)]
        if texts:
            return "\n".join(texts)
        if result.get("data") is not None:
            return str(result["data"])
    return result if isinstance(result, str) else json.dumps(result)
