"""from_text_env: any TextEnv behind the state-passing Environment face."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from fakes import DigitEnv, DigitEnvFactory

from agile_llmenvs.backends import ToolCall
from agile_llmenvs.core import (
    Action,
    Environment,
    EnvironmentSpec,
    State,
    StepResult,
    from_text_env,
    render_action,
)
from agile_llmenvs.errors import EnvExecutionError, StaleStateError


def test_reset_and_step_build_the_conversation() -> None:
    factory = DigitEnvFactory(turns=lambda row: 2)
    env = from_text_env(factory, name="digits")
    assert isinstance(env, Environment)
    state, info = env.reset(seed=9, options={"row_index": 4})
    assert info == {"row_index": 4, "seed": 9}
    assert state == State(
        observation="Say the digit 4.",
        messages=({"role": "user", "content": "Say the digit 4."},),
        task={"row_index": 4},
        episode_id=0,
        seed=9,
    )
    first = env.step(state, Action.from_text("4"))
    assert first == StepResult(
        next_state=State(
            observation="Say the digit 4.",
            messages=(
                {"role": "user", "content": "Say the digit 4."},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "Say the digit 4."},
            ),
            step_count=1,
            task={"row_index": 4},
            episode_id=0,
            seed=9,
        ),
        reward=1.0,
        info={"turn": 1},
    )
    last = env.step(first.next_state, Action(text="no"))
    assert (last.reward, last.terminated, last.done) == (0.0, True, True)
    assert last.next_state.done
    assert last.next_state.step_count == 2
    assert factory.made[1].actions == ["4", "no"]
    assert factory.made[1].closed  # the episode ended: its env is closed


def test_spec_is_read_from_a_probe_that_is_then_closed() -> None:
    class ToolEnv(DigitEnv):
        max_turns = 3
        tools = ({"type": "function", "function": {"name": "f"}},)

    made: list[DigitEnv] = []

    def factory() -> DigitEnv:
        made.append(ToolEnv())
        return made[-1]

    env = from_text_env(factory)
    assert env.spec == EnvironmentSpec(
        name="factory",
        pure_step=False,
        dataset_size=10,
        max_turns=3,
        tools=({"type": "function", "function": {"name": "f"}},),
    )
    assert len(made) == 1
    assert made[0].closed
    assert from_text_env(ToolEnv).spec.name == "ToolEnv"  # a class is a factory


def test_a_factory_runs_independent_episodes_at_once() -> None:
    factory = DigitEnvFactory(turns=lambda row: 2)
    env = from_text_env(factory)
    a, _ = env.reset(options={"row_index": 1})
    b, _ = env.reset(options={"row_index": 2})
    a1 = env.step(a, Action("1")).next_state
    b1 = env.step(b, Action("x")).next_state
    assert env.step(a1, Action("1")).reward == 1.0
    assert env.step(b1, Action("2")).reward == 1.0
    assert [e.actions for e in factory.made[1:]] == [["1", "1"], ["x", "2"]]


def test_stepping_a_state_twice_is_refused() -> None:
    env = from_text_env(DigitEnvFactory(turns=lambda row: 3))
    state, _ = env.reset(options={"row_index": 0})
    env.step(state, Action("0"))
    with pytest.raises(
        StaleStateError, match=r"^episode 0 at step 0 cannot be stepped: the env behind it"
    ):
        env.step(state, Action("0"))


def test_a_single_instance_runs_one_episode_at_a_time() -> None:
    instance = DigitEnv(turns=lambda row: 5)
    env = from_text_env(instance)
    assert env.spec.name == "DigitEnv"
    old, _ = env.reset(options={"row_index": 1})
    new, _ = env.reset(options={"row_index": 2})
    with pytest.raises(StaleStateError):
        env.step(old, Action("1"))
    assert env.step(new, Action("2")).reward == 1.0
    env.close()
    assert instance.closed


def test_release_closes_the_episode_env_and_close_closes_the_rest() -> None:
    factory = DigitEnvFactory(turns=lambda row: 5)
    env = from_text_env(factory)
    a, _ = env.reset(options={"row_index": 1})
    env.reset(options={"row_index": 2})
    env.release(a)
    env.release(a)  # a no-op the second time
    assert [e.closed for e in factory.made[1:]] == [True, False]
    with pytest.raises(StaleStateError):
        env.step(a, Action("1"))
    env.close()
    assert [e.closed for e in factory.made[1:]] == [True, True]


def test_an_env_error_propagates_and_frees_the_episode() -> None:
    factory = DigitEnvFactory(bad_steps=frozenset({3}))
    env = from_text_env(factory)
    state, _ = env.reset(options={"row_index": 3})
    with pytest.raises(RuntimeError, match="step of row 3 failed"):
        env.step(state, Action("3"))
    assert factory.made[1].closed
    with pytest.raises(KeyError, match="row 7 is broken"):
        from_text_env(DigitEnvFactory(bad_rows=frozenset({7}))).reset(options={"row_index": 7})


def test_tool_calls_reported_apart_are_rendered_for_the_env() -> None:
    call = ToolCall("add", {"a": 1})
    assert render_action(Action("sum:", (call,))) == (
        'sum:\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    )
    assert render_action(Action("", (call,))) == (
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    )
    written = 'x <tool_call>{"name": "add"}</tool_call>'
    assert render_action(Action(written, (call,))) == written  # a local model wrote it
    assert Action.from_text("hi") == Action(text="hi")


def test_only_text_envs_or_factories_adapt() -> None:
    not_an_env: Any = 42
    with pytest.raises(
        TypeError, match=r"^from_text_env needs a TextEnv or a factory of them; got int$"
    ):
        from_text_env(not_an_env)


class _Scored:
    """A one-step env whose reward is the number it was built with."""

    max_turns = 1

    def __init__(self, reward: Any) -> None:
        self.reward = reward

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        return "Say a digit.", {}

    def step(self, action: str) -> tuple[str, Any, bool, bool, dict[str, Any]]:
        return "", self.reward, True, False, {}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("pure_step", [False, True])
@pytest.mark.parametrize(
    ("reward", "shown"), [(float("nan"), "nan"), (float("-inf"), "-inf"), ("high", "'high'")]
)
def test_a_reward_that_is_not_a_finite_number_is_an_env_error(
    pure_step: bool, reward: Any, shown: str
) -> None:
    env = from_text_env(lambda: _Scored(reward), name="scored", pure_step=pure_step)
    state, _ = env.reset(seed=0)
    message = f"env 'scored', step 1: the reward is {shown}, not a finite number"
    with pytest.raises(EnvExecutionError, match="^" + re.escape(message)):
        env.step(state, Action.from_text("4"))
    fine = from_text_env(lambda: _Scored(0.5), name="scored", pure_step=pure_step)
    state, _ = fine.reset(seed=0)
    assert fine.step(state, Action.from_text("4")).reward == 0.5


class _Informed:
    """A one-step env whose reset (or step) info is the value it was built with."""

    max_turns = 1

    def __init__(self, info: dict[str, Any], *, at_reset: bool = False) -> None:
        self.info, self.at_reset = info, at_reset

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        return "Say a digit.", self.info if self.at_reset else {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "", 1.0, True, False, {} if self.at_reset else self.info

    def close(self) -> None:
        pass


@pytest.mark.parametrize("pure_step", [False, True])
@pytest.mark.parametrize(
    ("info", "shown"),
    [
        ({"score": float("nan")}, "info['score'] is nan"),
        ({"ok": 1.0, "parts": {"a": [0.5, float("inf")]}}, "info['parts']['a'][1] is inf"),
        ({"p": np.float32("-inf")}, "info['p'] is -inf"),
        ({"grid": np.array([[1.0, 2.0], [3.0, np.nan]])}, "info['grid'][1, 1] is nan"),
    ],
)
def test_a_non_finite_number_in_info_is_an_env_error_naming_its_key_path(
    pure_step: bool, info: dict[str, Any], shown: str
) -> None:
    env = from_text_env(lambda: _Informed(info), name="informed", pure_step=pure_step)
    state, _ = env.reset(seed=0)
    message = f"env 'informed', step 1: {shown}, not a finite number; return finite numbers in info"
    with pytest.raises(EnvExecutionError) as raised:
        env.step(state, Action.from_text("4"))
    assert str(raised.value) == message
    at_reset = from_text_env(
        lambda: _Informed(info, at_reset=True), name="informed", pure_step=pure_step
    )
    with pytest.raises(EnvExecutionError) as raised:
        at_reset.reset(seed=0)
    assert str(raised.value) == message.replace("step 1", "reset")
    fine = from_text_env(
        lambda: _Informed({"n": 1, "xs": np.arange(3), "s": "nan"}), name="informed"
    )
    state, _ = fine.reset(seed=0)
    assert fine.step(state, Action.from_text("4")).info["s"] == "nan"  # a string is no number
