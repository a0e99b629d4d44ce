"""OpenEnvWrapper: a plain text env as OpenEnv's typed Environment."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from echo_envs import EchoEnv

from agile_llmenvs.transport import OpenEnvWrapper, TextAction, TextObservation, TextState
from agile_llmenvs.transport._openenv import Environment
from agile_llmenvs.transport.wrapper import jsonable


def test_is_an_openenv_environment_that_supports_sessions() -> None:
    wrapper = OpenEnvWrapper(EchoEnv())
    assert isinstance(wrapper, Environment)
    assert OpenEnvWrapper.SUPPORTS_CONCURRENT_SESSIONS is True
    assert wrapper.env_name == "EchoEnv"
    assert wrapper.get_metadata().name == "EchoEnv"
    assert OpenEnvWrapper(EchoEnv(), env_name="echo").get_metadata().name == "echo"


def test_reset_passes_seed_and_task_and_info_travels_in_metadata() -> None:
    wrapper = OpenEnvWrapper(EchoEnv())
    observation = wrapper.reset(seed=3, episode_id="ep-1", row_index=2)
    assert observation == TextObservation(
        prompt="start seed=3", metadata={"task": {"row_index": 2}, "seed": 3}
    )
    assert (observation.done, observation.reward) == (False, None)
    assert wrapper.state.episode_id == "ep-1"


def test_step_types_the_five_tuple_and_labels_only_the_terminal_step() -> None:
    wrapper = OpenEnvWrapper(EchoEnv())
    wrapper.reset(seed=0)
    first = wrapper.step(TextAction(message="hello"))
    assert first.prompt == "1:hello"
    assert (first.reward, first.done, first.truncated) == (1.0, False, False)
    assert (first.question, first.answer) == (None, None)
    assert first.metadata == {"turn": 1, "scores": [1.5, 2.5]}  # numpy and tuples made JSON
    last = wrapper.step(TextAction(message="stop"))
    assert (last.done, last.truncated) == (True, False)
    assert (last.question, last.answer) == ("what to say?", "stop")
    assert wrapper.state.step_count == 2


def test_truncation_travels_on_the_observation() -> None:
    wrapper = OpenEnvWrapper(EchoEnv())
    wrapper.reset()
    observations = [wrapper.step(TextAction(message="go")) for _ in range(5)]
    assert [o.done for o in observations] == [False, False, False, False, True]
    assert observations[-1].truncated is True


class _Rubric:
    def __init__(self) -> None:
        self.last_score = 0.5

    def named_rubrics(self) -> list[tuple[str, Any]]:
        return [("exact", self), ("length", self)]


def test_state_carries_dataset_size_tools_turn_budget_and_rubric_components() -> None:
    env = EchoEnv()
    env.tools = ({"name": "calc", "parameters": {"type": "object"}},)  # type: ignore[attr-defined]
    env.rubric = _Rubric()  # type: ignore[attr-defined]
    state = OpenEnvWrapper(env).state
    assert isinstance(state, TextState)
    assert state.dataset_size == 3
    assert state.max_turns == 5
    assert state.tools == [{"name": "calc", "parameters": {"type": "object"}}]
    assert state.rubric_components == {"exact": 0.5, "length": 0.5}


def test_close_closes_the_inner_env_only_when_owned() -> None:
    shared, owned = EchoEnv(), EchoEnv()
    OpenEnvWrapper(shared).close()
    wrapper = OpenEnvWrapper(owned, owns_inner=True)
    wrapper.close()
    wrapper.close()
    assert (shared.closed, owned.closed) == (False, True)


def test_jsonable() -> None:
    value = {
        "a": np.float32(1.5),
        "b": np.arange(3),
        4: {1, 2},
        "c": (np.bool_(True),),
        "d": float("nan"),
    }
    converted = jsonable(value)
    assert math.isnan(converted.pop("d"))  # kept a float: the reply paths refuse it by name
    assert converted == {"a": 1.5, "b": [0, 1, 2], "4": [1, 2], "c": [True]}


def test_step_frame_is_the_frame_of_step_byte_for_byte() -> None:
    from agile_llmenvs.transport.protocol import observation_frame

    framed, typed = OpenEnvWrapper(EchoEnv()), OpenEnvWrapper(EchoEnv())
    framed.reset(seed=1)
    typed.reset(seed=1)
    for text in ["a", "b", "c", "d", "e"]:  # the fifth step is truncated
        assert framed.step_frame(text) == observation_frame(typed.step(TextAction(message=text)))
    framed.reset(seed=2)
    typed.reset(seed=2)
    last = framed.step_frame("stop")
    assert last == observation_frame(typed.step(TextAction(message="stop")))
    assert '"question":"what to say?"' in last
    assert framed.state.step_count == typed.state.step_count == 1
