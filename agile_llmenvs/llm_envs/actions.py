"""Playing one sampled completion against the env: reasoning stripped, tool calls run in order.

The env receives the completion's text without its reasoning block (when ``strip_reasoning``
is on). With tools (``mcp_tool``), the completion's tool calls are parsed in the configured
format; every call runs, in order, and each result goes back in the template's tool role
(or, for a template without one, all of them in one user message). A call inside a reasoning
block is not a call. A malformed call reaches no tool: the turn scores
``malformed_tool_call_reward`` and the policy is told why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from agile_llmenvs.errors import EnvError
from agile_llmenvs.llm_envs.framing import ChatFramer
from agile_llmenvs.llm_envs.tool_calls import ToolCall, parse_tool_calls, strip_reasoning
from agile_llmenvs.transport.types import EnvReply

__all__ = ["MALFORMED_FEEDBACK", "ActionOutcome", "ActionPlayer"]

MALFORMED_FEEDBACK = (
    "Error: your tool call could not be parsed ({reason}). Call a tool as "
    '<tool_call>{{"name": "...", "arguments": {{...}}}}</tool_call>.'
)
_DEFAULT_REASONING = ("<think>", "</think>")


@dataclass
class ActionOutcome:
    """What one turn's action did.

    Attributes:
        reward: The turn's reward (the sum over its tool calls).
        info: Env metadata and the harness's keys (``tool_calls``, ``malformed_tool_call``,
            ``action_error``, ``error``...).
        observations: The messages the policy sees next (empty when the env failed).
        reply: The env's last reply (None when no env call was made or it failed).
    """

    reward: float
    info: dict[str, Any] = field(default_factory=dict)
    observations: list[dict[str, Any]] = field(default_factory=list)
    reply: EnvReply | None = None

    @property
    def failed(self) -> bool:
        """Whether the env failed (an exception, a lost connection, a timeout)."""
        return "error" in self.info


class ActionPlayer:
    """Sends a completion's action to an env client (see the module docstring).

    Args:
        client: The env client.
        framer: The policy's chat framer (its template's tool role and reasoning block).
        observation_text: Turns an env reply into the text the policy reads.
        config: The harness's settings (``mcp_tool``, ``action_field``,
            ``tool_call_parser``, ``strip_reasoning``, ``reasoning_delimiters``,
            ``action_error_field``, ``malformed_tool_call_reward``).
    """

    def __init__(
        self,
        client: Any,
        framer: ChatFramer,
        observation_text: Callable[[EnvReply], str],
        config: Any,
    ) -> None:
        self.client, self.framer, self.config = client, framer, config
        self.observation_text = observation_text
        self.delimiters = config.reasoning_delimiters or framer.reasoning or _DEFAULT_REASONING
        strip = config.strip_reasoning
        self.strip = framer.reasoning is not None if strip is None else bool(strip)

    def env_text(self, text: str) -> str:
        """The text the env receives: ``text`` without its reasoning block when stripping."""
        if not self.strip:
            return text
        return strip_reasoning(
            text, self.delimiters, starts_in_reasoning=self.framer.starts_in_reasoning
        )

    def play(self, text: str, completion_ids: Sequence[int]) -> ActionOutcome:
        """Play a completion: its ``text`` (decoded without special tokens) goes to the env;
        tool calls are read from its ids decoded with special tokens, where markers such as
        ``[TOOL_CALLS]`` live."""
        config = self.config
        action = self.env_text(text)
        if not config.mcp_tool:
            return self._send(lambda: self.client.step(action))
        parsed = parse_tool_calls(
            self.framer.decode(completion_ids, skip_special_tokens=False),
            config.tool_call_parser,
            reasoning=self.delimiters,
            starts_in_reasoning=self.framer.starts_in_reasoning,
        )
        if parsed.error is not None:
            feedback = MALFORMED_FEEDBACK.format(reason=parsed.error)
            return ActionOutcome(
                config.malformed_tool_call_reward,
                {"malformed_tool_call": parsed.error, "feedback": feedback},
                [{"role": "user", "content": feedback}],
            )
        if not parsed.calls:
            arguments = {config.action_field: action}
            return self._send(lambda: self.client.call_tool(config.mcp_tool, arguments))
        return self._run_calls(parsed.calls)

    def _run_calls(self, calls: Sequence[ToolCall]) -> ActionOutcome:
        outcome = ActionOutcome(0.0, {"tool_calls": []})
        texts: list[str] = []
        for index, call in enumerate(calls):
            step = self._send(partial(self.client.call_tool, call.name, call.arguments))
            outcome.reward += step.reward
            outcome.info.update({k: v for k, v in step.info.items() if k != "tool_calls"})
            outcome.info["tool_calls"].append({"name": call.name, "reward": step.reward})
            outcome.reply = step.reply
            if step.failed:
                return outcome
            texts.append(step.observations[0]["content"])
            if step.reply is not None and step.reply.done:
                skipped = len(calls) - index - 1
                if skipped:
                    outcome.info["tool_calls_skipped"] = skipped
                break
        role = self.framer.observation_role("tool")
        if role == "user":
            outcome.observations = [{"role": "user", "content": "\n\n".join(texts)}]
        else:
            outcome.observations = [{"role": role, "content": text} for text in texts]
        return outcome

    def _send(self, call: Callable[[], EnvReply]) -> ActionOutcome:
        """One env call; an env failure never reaches the caller as an exception."""
        try:
            reply = call()
        except EnvError as exc:
            return ActionOutcome(0.0, {"error": f"{type(exc).__name__}: {exc}"})
        info = dict(reply.metadata)
        field_name = self.config.action_error_field
        if field_name:
            error = reply.observation.get(field_name) or reply.metadata.get(field_name)
            if error:
                info["action_error"] = error
        text = "" if reply.done else self.observation_text(reply)
        observations = [{"role": "user", "content": text}]
        return ActionOutcome(float(reply.reward or 0.0), info, observations, reply)
