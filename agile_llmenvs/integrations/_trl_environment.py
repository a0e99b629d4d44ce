"""TRL's ``environment_factory``: the class ``GRPOTrainer`` makes one of per rollout, playing a
manifest's env through our harness's env side.

TRL 1.16 generates the turns itself and plays an episode as tool calls: it renders the prompt
with the environment's public methods as tools, parses each completion's tool calls with the
tokenizer's response schema, calls the methods, appends each result in the template's tool
role, and generates again until a completion calls no tool. The ids it trains on are the ids
it sampled and the ids the chat template renders for the tool results, never re-encoded text.

The tools offered are the env's own:

* an MCP env (one that lists tools): one method per tool, its arguments and description those
  the env lists; a call runs the tool exactly as the harness runs a parsed tool call
  (:meth:`~agile_llmenvs.llm_envs.actions.ActionPlayer.run_calls`), and the result is the text
  the harness would show in the tool role;
* a text env: one method, :data:`ACT_TOOL` (``act(action: str)``), that sends ``action`` as the
  turn's text (:meth:`~agile_llmenvs.llm_envs.actions.ActionPlayer.play`) and returns the next
  observation as the harness shows it.

``reset`` resets the env to the dataset row's task (the row's ``task`` column) and returns
None: the row's prompt already is the task's first prompt. Once the env ends the episode (or
its ``max_turns`` env turns are spent) every further call answers :data:`EPISODE_OVER` and
reaches no env. ``get_reward`` is the sum of the episode's rewards; an episode the env failed
(it raised, or a call failed) scores None, which TRL leaves out of its group's statistics.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agile_llmenvs.errors import EnvProtocolError
from agile_llmenvs.llm_envs.actions import ActionOutcome, drive
from agile_llmenvs.llm_envs.harness import RolloutHarness
from agile_llmenvs.llm_envs.tasks import Task
from agile_llmenvs.llm_envs.tool_calls import ToolCall

__all__ = ["ACT_TOOL", "EPISODE_OVER", "ToolEnvironments", "environment_class", "tool_signature"]

#: What a tool call answers once the episode is over (no env is called).
EPISODE_OVER = "The episode is over."

#: The one tool a text env offers: its schema as the env's method declares it.
ACT_TOOL: dict[str, Any] = {
    "name": "act",
    "description": "Take your turn in the environment: send your action as text.",
    "inputSchema": {
        "type": "object",
        "properties": {"action": {"type": "string", "description": "Your action, as text."}},
        "required": ["action"],
    },
}

_PYTHON_TYPES: dict[str, Any] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "array": list,
    "object": dict,
}


class ToolEnvironments:
    """What a :class:`~agile_llmenvs.integrations.trl.TRLEnv` gives TRL's
    ``environment_factory``: the env's class (:attr:`environment_class`), its tools as TRL
    renders them (:meth:`schemas`), and the harnesses its instances hold, closed together.

    Args:
        harness_factory: Builds one harness of the env.
        tasks: The env's tasks, indexed by the dataset's ``task`` column.

    Raises:
        ValueError: a listed tool cannot be a method (see :func:`environment_class`).
    """

    def __init__(self, harness_factory: Callable[[], RolloutHarness], tasks: Sequence[Task]):
        self.harnesses: list[RolloutHarness] = []
        probe = harness_factory()
        self.harnesses.append(probe)
        self.tools = _listed_tools(probe)
        self.environment_class = environment_class(
            harness_factory,
            tasks,
            self.tools,
            max_turns=probe.config.max_turns,
            harnesses=self.harnesses,
        )

    def schemas(self) -> list[dict[str, Any]]:
        """The tools exactly as TRL renders them into the prompt (``get_json_schema`` of each
        method, in TRL's order): give them to the harness's ``chat_template_kwargs`` as
        ``tools`` and it renders the same ids."""
        from transformers.utils import get_json_schema

        members = inspect.getmembers(self.environment_class, predicate=inspect.isfunction)
        return [
            get_json_schema(method)
            for name, method in members
            if name not in ("reset", "get_reward") and not name.startswith("_")
        ]

    def close(self) -> None:
        """Close every instance's env."""
        harnesses, self.harnesses[:] = list(self.harnesses), []
        for harness in harnesses:
            harness.close()


def _listed_tools(harness: RolloutHarness) -> list[dict[str, Any]]:
    """The tools an MCP env lists (none for an env that is not one)."""
    try:
        return list(harness.client.list_tools())
    except EnvProtocolError:
        return []


class _EpisodeState:
    """One rollout's episode: its rewards, whether it is over, whether the env failed."""

    def __init__(self) -> None:
        self.rewards: list[float] = []
        self.over = False
        self.failed = False


def environment_class(
    harness_factory: Callable[[], RolloutHarness],
    tasks: Sequence[Task],
    tools: Sequence[Mapping[str, Any]],
    *,
    max_turns: int,
    harnesses: list[RolloutHarness],
    name: str = "ManifestEnvironment",
) -> type:
    """The class TRL's ``environment_factory`` instantiates (see the module docstring).

    Args:
        harness_factory: Builds one harness of the env (each instance holds its own).
        tasks: The env's tasks, indexed by the dataset's ``task`` column.
        tools: The env's listed tools (MCP shape: ``name``, ``description``,
            ``inputSchema``); empty for a text env, which offers :data:`ACT_TOOL`.
        max_turns: Env turns an episode may take (the env spec's ``max_turns``).
        harnesses: Where each instance's harness is recorded, for its owner to close (every
            public method of the class is a tool to TRL, so it has no ``close``).
        name: The class's name (TRL logs the reward under it).
    """
    namespace: dict[str, Any] = {
        "__doc__": "One rollout's env for TRL's GRPOTrainer (agile_llmenvs).",
        "__init__": _init(harness_factory, harnesses),
        "reset": _reset(tasks),
        "get_reward": _get_reward,
        "_call": _call,
        "_max_turns": max_turns,
        "_play": _play_tool if tools else _play_text,
    }
    for tool in tools or [ACT_TOOL]:
        tool_name = str(tool["name"])
        if tool_name in namespace or tool_name.startswith("_"):
            raise ValueError(
                f"the env's tool {tool_name!r} cannot be a TRL environment method (its name is "
                "reset, get_reward, or starts with an underscore)"
            )
        namespace[tool_name] = _tool_method(tool)
    return type(name, (), namespace)


def tool_signature(tool: Mapping[str, Any]) -> tuple[inspect.Signature, str]:
    """A listed tool as a Python method's signature and Google-style docstring, which
    ``transformers.utils.get_json_schema`` (what TRL renders the tools with) reads back as
    the tool's name, description, argument types and descriptions, and required arguments.

    Raises:
        ValueError: an argument's JSON type has no Python counterpart (``null``, a union).
    """
    schema = tool.get("inputSchema") or tool.get("input_schema") or tool.get("parameters") or {}
    properties: Mapping[str, Any] = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    lines = [str(tool.get("description") or f"The {tool['name']} tool.").strip(), "", "Args:"]
    for arg, spec in properties.items():
        kind = _PYTHON_TYPES.get(str(spec.get("type")))
        if kind is None:
            raise ValueError(
                f"tool {tool['name']!r}: argument {arg!r} has JSON type {spec.get('type')!r}, "
                f"which a TRL tool method cannot declare (one of {sorted(_PYTHON_TYPES)})"
            )
        default = inspect.Parameter.empty if arg in required else None
        annotation = kind if arg in required else kind | None
        parameters.append(
            inspect.Parameter(
                arg, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
            )
        )
        lines.append(f"    {arg}: {spec.get('description') or f'The {arg} argument.'}")
    if not properties:
        lines = lines[:1]
    return inspect.Signature(parameters, return_annotation=str), "\n".join(lines)


def _tool_method(tool: Mapping[str, Any]) -> Callable[..., str]:
    """The method TRL calls for ``tool``: its arguments go to the episode's env."""
    tool_name = str(tool["name"])
    signature, doc = tool_signature(tool)

    def method(self: Any, **arguments: Any) -> str:
        return self._call(tool_name, arguments)

    method.__name__ = method.__qualname__ = tool_name
    method.__doc__ = doc
    method.__signature__ = signature  # type: ignore[attr-defined]
    method.__annotations__ = {
        p.name: p.annotation for p in signature.parameters.values() if p.name != "self"
    }
    method.__annotations__["return"] = str
    return method


def _init(
    harness_factory: Callable[[], RolloutHarness], harnesses: list[RolloutHarness]
) -> Callable[[Any], None]:
    def __init__(self: Any) -> None:
        self._harness = harness_factory()
        harnesses.append(self._harness)  # closed by their TRLEnv: TRL closes no environment
        self._episode = _EpisodeState()
        self._episode.over = True  # until the first reset

    return __init__


def _reset(tasks: Sequence[Task]) -> Callable[..., None]:
    def reset(self: Any, task: int = 0, **row: Any) -> None:
        """Start an episode of the dataset row's task; the row's prompt is its first prompt."""
        self._episode = _EpisodeState()
        try:
            self._harness.reset(**tasks[int(task)].reset_kwargs())
        except Exception:
            self._episode.failed = self._episode.over = True
            raise
        return None

    return reset


def _get_reward(self: Any) -> float | None:
    """The episode's return (None when the env failed it)."""
    episode = self._episode
    return None if episode.failed else float(sum(episode.rewards))


def _call(self: Any, name: str, arguments: dict[str, Any]) -> str:
    """One tool call: played on the env unless the episode is over; the result's text."""
    episode: _EpisodeState = self._episode
    if episode.over:
        return EPISODE_OVER
    outcome: ActionOutcome = self._play(name, arguments)
    episode.rewards.append(outcome.reward)
    reply = outcome.reply
    if outcome.failed:
        episode.failed = episode.over = True
        return f"The environment failed: {outcome.info.get('error', 'unknown error')}"
    if (reply is not None and reply.done) or len(episode.rewards) >= self._max_turns:
        episode.over = True
        return EPISODE_OVER
    texts = [str(message["content"]) for message in outcome.observations]
    return "\n\n".join(texts)


def _play_tool(self: Any, name: str, arguments: dict[str, Any]) -> ActionOutcome:
    harness: RolloutHarness = self._harness
    return drive(harness.player.run_calls([ToolCall(name, dict(arguments))]), harness.client)


def _play_text(self: Any, name: str, arguments: dict[str, Any]) -> ActionOutcome:
    harness: RolloutHarness = self._harness
    action = str(arguments.get("action", ""))
    return drive(harness.player.play(action, ()), harness.client)
