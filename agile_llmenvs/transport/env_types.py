"""The action, observation and state classes an env server validates against and publishes.

OpenEnv's ``create_app`` is told them; :class:`~agile_llmenvs.transport.OpenEnvServer` takes
them the same way, or reads them off the env's own annotations: ``step(self, action: A) -> O``
and ``state -> S``. Our text envs (wrapped in :class:`OpenEnvWrapper`) use
:class:`TextAction` / :class:`TextObservation` / :class:`TextState`.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass
from typing import Any

from agile_llmenvs.transport._openenv import Action, Environment, Observation, State
from agile_llmenvs.transport.types import TextAction, TextObservation, TextState
from agile_llmenvs.transport.wrapper import OpenEnvWrapper

__all__ = ["EnvTypes", "infer_env_types"]


@dataclass(frozen=True)
class EnvTypes:
    """The wire types of one served env.

    Attributes:
        action: The action class every step is validated against.
        observation: The observation class ``step`` returns (published in ``/schema``).
        reset_observation: The observation class ``reset`` returns.
        state: The state class (published in ``/schema``).
    """

    action: type[Any]
    observation: type[Any]
    reset_observation: type[Any]
    state: type[Any]

    def schema(self) -> dict[str, Any]:
        """The ``GET /schema`` body, as OpenEnv's ``create_app`` serves it."""
        return {
            "action": self.action.model_json_schema(),
            "observation": self.observation.model_json_schema(),
            "state": self.state.model_json_schema(),
            "reset_observation": self.reset_observation.model_json_schema(),
        }


_TEXT = EnvTypes(TextAction, TextObservation, TextObservation, TextState)


def infer_env_types(
    env: type[Any] | Any,
    *,
    action_cls: type[Any] | None = None,
    observation_cls: type[Any] | None = None,
    state_cls: type[Any] | None = None,
) -> EnvTypes:
    """The wire types of ``env`` (an env or its class): those given, else its annotations.

    Order, for the action class: ``action_cls``; the env's ``ACTION_CLS`` attribute (the
    older way to say it); the annotation of ``step``'s ``action`` parameter; OpenEnv's base
    ``Action`` (which takes MCP's ``list_tools`` / ``call_tool`` actions). The observation
    class comes from ``step``'s return annotation, the state class from the ``state``
    property's, each falling back to OpenEnv's base class.

    An annotation that is not such a class (``Any``, a union) is passed over.

    Raises:
        TypeError: a given class is not a subclass of OpenEnv's ``Action`` /
            ``Observation`` / ``State`` (the message names the parameter to fix).
    """
    cls = env if isinstance(env, type) else type(env)
    if issubclass(cls, OpenEnvWrapper) and action_cls is None and observation_cls is None:
        return _TEXT
    hints = _hints(getattr(cls, "step", None))
    state_hints = _hints(getattr(getattr(cls, "state", None), "fget", None))
    for name, value, base in (
        ("action_cls", action_cls, Action),
        ("observation_cls", observation_cls, Observation),
        ("state_cls", state_cls, State),
    ):
        if value is not None and not (isinstance(value, type) and issubclass(value, base)):
            raise TypeError(
                f"{name}={value!r} for {cls.__name__} is not a subclass of OpenEnv's "
                f"{base.__name__}; pass the env's own {base.__name__} class as `{name}`"
            )
    action = (
        action_cls
        or getattr(cls, "ACTION_CLS", None)
        or _subclass(hints.get("action"), Action)
        or Action
    )
    observation = observation_cls or _subclass(hints.get("return"), Observation) or Observation
    state = state_cls or _subclass(state_hints.get("return"), State) or State
    return EnvTypes(action, observation, observation, state)


def _hints(function: Any) -> dict[str, Any]:
    """``function``'s resolved annotations (empty when missing or unresolvable)."""
    if function is None or function in (Environment.step, Environment.state.fget):
        return {}
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # a forward reference the env's module cannot resolve
        return {}
    if "action" not in hints:  # the first parameter after self, whatever its name
        params = [p for p in inspect.signature(function).parameters.values()][1:2]
        if params and params[0].name in hints:
            hints["action"] = hints[params[0].name]
    return hints


def _subclass(annotation: Any, base: type) -> type | None:
    """``annotation`` when it is a subclass of ``base`` (``Any``, unions and the like: None)."""
    if isinstance(annotation, type) and issubclass(annotation, base):
        return annotation
    return None
