"""The text the policy reads when no ``observation_field`` is set.

A structured observation with one string field shows that field; a text env's observation
(``prompt``, with string ``question`` / ``answer`` on its terminal step) shows ``prompt``; an
MCP env, whose reset observation is empty, is introduced by the tools it lists, in-process
and served by OpenEnv's own ``create_app``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from serving import UvicornApp

from agile_llmenvs.errors import EnvProtocolError
from agile_llmenvs.llm_envs import InProcessEnvClient, RolloutHarness
from agile_llmenvs.transport import TextObservation
from agile_llmenvs.transport._openenv import Environment, Observation, State
from agile_llmenvs.transport.types import EnvReply

EOS = 2  # <|im_end|> of the tiny model's tokenizer
FIRST = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # the first prompt's frame
NEXT = "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # after an <|im_end|>
# The first prompt of the MCP env below: its two tools, in the order it registers them.
TOOLS_PROMPT = (
    "Tools you can call:\n"
    "- add: Add two integers.\n"
    '  input schema: {"additionalProperties": false, "properties": {"a": {"type": "integer"}, '
    '"b": {"type": "integer"}}, "required": ["a", "b"], "type": "object"}\n'
    "- shout: Upper-case the message.\n"
    '  input schema: {"additionalProperties": false, "properties": {"message": {"type": '
    '"string"}}, "required": ["message"], "type": "object"}'
)


def wire(observation: dict[str, Any]) -> EnvReply:
    """The reply to an observation frame as OpenEnv 0.10's server sends it (metadata nested)."""
    return EnvReply.from_wire({"observation": observation, "reward": None, "done": False})


@pytest.mark.parametrize(
    ("observation", "text"),
    [
        ({"text": "Guess.", "attempts_left": 3, "metadata": {"hint": "red"}}, "Guess."),
        ({"board": [[0, 1]], "score": 2, "note": None, "message": "Your move."}, "Your move."),
        # a text env's terminal step: prompt wins over the string labels
        (TextObservation(prompt="Bye.", question="2+2?", answer="4").model_dump(), "Bye."),
        (
            {"tool_name": "shout", "result": {"content": [{"type": "text", "text": "HI!"}]}},
            "HI!",
        ),
        # several string fields, or none: the observation as JSON (set observation_field)
        (
            {"stdout": "4\n", "stderr": "", "exit_code": 0},
            '{"stdout": "4\\n", "stderr": "", "exit_code": 0}',
        ),
        ({"board": [[0, 1]], "score": 2}, '{"board": [[0, 1]], "score": 2}'),
    ],
)
def test_the_text_of_an_observation(observation: dict[str, Any], text: str) -> None:
    assert wire(observation).prompt == text


class CountdownObservation(Observation):
    """A structured observation with one string field."""

    text: str
    attempts_left: int


class CountdownEnv(Environment):
    """An OpenEnv-native env whose observation is structured; only its reset is played."""

    def __init__(self) -> None:
        super().__init__()
        self._state = State()

    def reset(self, seed: Any = None, episode_id: Any = None, **kwargs: Any) -> Any:
        return CountdownObservation(text="Count down from 3.", attempts_left=3)

    def step(self, action: Any, timeout_s: Any = None, **kwargs: Any) -> Any:
        raise NotImplementedError

    @property
    def state(self) -> State:
        return self._state


class SilentEnv(CountdownEnv):
    """A non-MCP env whose reset observation is empty."""

    def reset(self, seed: Any = None, episode_id: Any = None, **kwargs: Any) -> Any:
        return Observation(metadata={"ready": True})


def test_a_structured_observation_shows_its_one_string_field(tokenizer: Any) -> None:
    harness = RolloutHarness.local(CountdownEnv(), tokenizer)
    assert tokenizer.decode(harness.reset()) == FIRST.format("Count down from 3.")
    named = RolloutHarness.local(CountdownEnv(), tokenizer, observation_field="attempts_left")
    assert tokenizer.decode(named.reset()) == FIRST.format("3")


def test_an_empty_reset_of_an_env_without_tools_stays_as_it_is(tokenizer: Any) -> None:
    client = InProcessEnvClient(SilentEnv())
    client.reset()
    with pytest.raises(
        EnvProtocolError,
        match=r"^in-process env 'SilentEnv' is not an MCP environment: it has no tools to list$",
    ):
        client.list_tools()
    harness = RolloutHarness(InProcessEnvClient(SilentEnv()), tokenizer)
    assert tokenizer.decode(harness.reset()) == FIRST.format("{}")


def _mcp_env() -> Any:
    from fastmcp import FastMCP
    from openenv.core.env_server.mcp_environment import MCPEnvironment

    class ToolsEnv(MCPEnvironment):
        """An MCP env with two tools; its reset says nothing."""

        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            mcp = FastMCP("tools")

            @mcp.tool()
            def add(a: int, b: int) -> int:
                """Add two integers."""
                return a + b

            @mcp.tool()
            def shout(message: str) -> str:
                """Upper-case the message."""
                return message.upper() + "!"

            super().__init__(mcp)
            self._state = State()

        def reset(self, seed: Any = None, episode_id: Any = None, **kwargs: Any) -> Any:
            return Observation(metadata={"ready": True})

        def _step_impl(self, action: Any, timeout_s: Any = None, **kwargs: Any) -> Any:
            return Observation(reward=0.0)

        @property
        def state(self) -> State:
            return self._state

    return ToolsEnv()


@pytest.fixture(scope="module")
def mcp_url() -> Iterator[str]:
    """The MCP env served by OpenEnv's own ``create_app`` under uvicorn."""
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

    app = create_app(_mcp_env, CallToolAction, CallToolObservation, max_concurrent_envs=2)
    with UvicornApp(app) as served:
        yield served.url


def test_a_served_mcp_env_first_prompt_lists_its_tools(mcp_url: str, tokenizer: Any) -> None:
    harness = RolloutHarness(mcp_url, tokenizer, 2, mcp_tool="shout", timeout_s=10)
    assert tokenizer.decode(harness.reset()) == FIRST.format(TOOLS_PROMPT)
    assert harness.info == {"ready": True}
    result = harness.step([*tokenizer.encode("hello", add_special_tokens=False), EOS])
    assert tokenizer.decode(result.prompt_ids) == NEXT.format("HELLO!")
    assert tokenizer.decode(harness.reset()) == FIRST.format(TOOLS_PROMPT)  # every episode
    harness.close()


def test_an_in_process_mcp_env_lists_the_same_tools(tokenizer: Any) -> None:
    client = InProcessEnvClient(_mcp_env())
    client.reset()
    tools = client.list_tools()
    assert [tool["name"] for tool in tools] == ["add", "shout"]
    assert tools[1] == {
        "name": "shout",
        "description": "Upper-case the message.",
        "input_schema": json.loads(TOOLS_PROMPT.rsplit("input schema: ", 1)[1]),
    }
    harness = RolloutHarness(InProcessEnvClient(_mcp_env()), tokenizer, mcp_tool="shout")
    assert tokenizer.decode(harness.reset()) == FIRST.format(TOOLS_PROMPT)
