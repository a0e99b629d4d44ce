"""Playing one sampled completion against the env: reasoning stripped, tool calls run in order.

The env receives the completion's text without its reasoning block (when ``strip_reasoning``
is on). With tools (``mcp_tool``), the completion's tool calls are parsed in the configured
format; every call runs, in order, and each result goes back in the template's tool role
(or, for a template without one, all of them in one user message). A call inside a reasoning
block is not a call. A malformed call reaches no tool: the turn scores
``malformed_tool_call_reward`` and the policy is told why.

An action the env's action class refuses (text that is no ``int`` for an ``int`` field, say:
the client's ``VALIDATION_ERROR`` naming the fields), or that the ``action_parser`` refuses
with a ``ValueError``, is the policy's mistake, not the env's: an invalid turn that scores
``invalid_action_reward`` and shows the policy which field was wrong and why
(:data:`INVALID_ACTION_FEEDBACK`). The episode goes on. An env's own exception still fails it.

The turn logic makes no env call itself (sans-IO): it is a generator (an :data:`EnvTurn`) that
yields each env call as an :class:`EnvCall` value and receives the reply, or has the call's
exception thrown in. Two thin drivers perform the calls: :func:`drive` on the client's blocking
API, :meth:`AsyncEnvCalls.drive` on its async API (a remote session's, on the session loop) or,
for an env in this process, on a thread or inline. So the sync and async paths cannot drift.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agile_llmenvs.errors import EnvError, EnvProtocolError
from agile_llmenvs.llm_envs.framing import ChatFramer
from agile_llmenvs.llm_envs.image_framing import (
    PromptRenderer,
    content_text,
    message_images,
    with_images,
)
from agile_llmenvs.llm_envs.tool_calls import ToolCall, parse_tool_calls, strip_reasoning
from agile_llmenvs.transport.calls import CallPolicy
from agile_llmenvs.transport.client import InProcessEnvClient
from agile_llmenvs.transport.images import ImageObservationError
from agile_llmenvs.transport.types import EnvReply

__all__ = [
    "INVALID_ACTION_FEEDBACK",
    "MALFORMED_FEEDBACK",
    "ActionOutcome",
    "ActionPlayer",
    "AsyncEnvCalls",
    "EnvCall",
    "EnvTurn",
    "cut_observation",
    "drive",
]

T = TypeVar("T")

MALFORMED_FEEDBACK = (
    "Error: your tool call could not be parsed ({reason}). Call a tool as "
    '<tool_call>{{"name": "...", "arguments": {{...}}}}</tool_call>.'
)
INVALID_ACTION_FEEDBACK = "Error: your action is not valid: {reason}"
"""The observation of an invalid turn; ``reason`` names each invalid field and why
(``guess: Input should be a valid integer, ...``, several joined by ``; ``) or is the
``action_parser``'s ``ValueError`` message."""
_DEFAULT_REASONING = ("<think>", "</think>")


@dataclass(frozen=True)
class EnvCall:
    """One env call as a value: the client method's name (``reset``, ``step``,
    ``call_tool``, ``list_tools``, ``state``) and its arguments."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, client: Any) -> Any:
        """Make the call on ``client``'s blocking API."""
        return getattr(client, self.method)(*self.args, **self.kwargs)


EnvTurn = Generator[EnvCall, Any, T]
"""Turn logic: yields the env calls to make, receives each reply, returns the turn's result."""


def drive(turn: EnvTurn[T], client: Any) -> T:
    """Run ``turn`` with its env calls made on ``client``'s blocking API, one at a time."""
    try:
        call = next(turn)
        while True:
            try:
                reply = call(client)
            except Exception as exc:  # the turn decides: an env failure is a value there
                call = turn.throw(exc)
            else:
                call = turn.send(reply)
    except StopIteration as stop:
        return stop.value


class AsyncEnvCalls:
    """The async driver: how an awaited turn makes its env calls.

    A client with an async API (``areset``, ``astep``, ... as :class:`RemoteEnvClient` has)
    is awaited: on the session loop that needs no thread per session. Otherwise the blocking
    call runs on ``executor`` (None: the loop's default) or, for an in-process env class that
    ``policy`` has seen to be fast, inline on the loop, as the lock-step collector does (see
    :class:`~agile_llmenvs.transport.calls.CallPolicy`).

    Args:
        policy: Judges which in-process env classes run inline (default: a fresh ``auto``).
        executor: Where blocking env calls run.
    """

    def __init__(self, policy: CallPolicy | None = None, executor: Executor | None = None) -> None:
        self.policy = policy or CallPolicy("auto")
        self.executor = executor

    async def drive(self, turn: EnvTurn[T], client: Any) -> T:
        """As :func:`drive`, each call awaited (see the class docstring)."""
        try:
            call = next(turn)
            while True:
                try:
                    reply = await self.perform(call, client)
                except Exception as exc:
                    call = turn.throw(exc)
                else:
                    call = turn.send(reply)
        except StopIteration as stop:
            return stop.value

    async def perform(self, call: EnvCall, client: Any) -> Any:
        """Make one env call without blocking the loop (except an inline, proven-fast one)."""
        native = getattr(client, f"a{call.method}", None)
        if native is not None:
            return await native(*call.args, **call.kwargs)
        env_class = in_process_env_class(client)
        if env_class is not None and self.policy.inline(env_class):
            return self._timed(env_class, call, client)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self._timed, env_class, call, client)

    def _timed(self, env_class: type | None, call: EnvCall, client: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(client)
        finally:
            if env_class is not None:
                self.policy.record(env_class, time.perf_counter() - start)


def in_process_env_class(client: Any) -> type | None:
    """The class whose call times the call policy judges: an in-process env's (None for any
    other client: its waiting is what runs concurrently)."""
    if not isinstance(client, InProcessEnvClient):
        return None
    env = client.env
    return type(getattr(env, "inner", env))


@dataclass
class ActionOutcome:
    """What one turn's action did.

    Attributes:
        reward: The turn's reward (the sum over its tool calls).
        info: Env metadata and the harness's keys (``tool_calls``, ``malformed_tool_call``,
            ``invalid_action``, ``action_error``, ``error``...).
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
    """Plays a completion's action as env calls (see the module docstring).

    Args:
        framer: The policy's chat framer (its template's tool role and reasoning block).
        observation_text: Turns an env reply into the text the policy reads.
        config: The harness's settings (``mcp_tool``, ``action_field``, ``action_parser``,
            ``tool_call_parser``, ``strip_reasoning``, ``reasoning_delimiters``,
            ``action_error_field``, ``malformed_tool_call_reward``,
            ``invalid_action_reward``).
        renderer: What the policy is shown of a reply: its images, decoded (an
            :class:`~agile_llmenvs.transport.images.ImageObservationError` for images it
            cannot show), and its info without them.
        text_field: The action field the client sends the text in (the client's own
            ``action_field``; default the config's): a refusal of that field's value is
            the policy's, an invalid turn.
    """

    def __init__(
        self,
        framer: ChatFramer,
        observation_text: Callable[[EnvReply], str],
        config: Any,
        *,
        renderer: PromptRenderer,
        text_field: str | None = None,
    ) -> None:
        self.framer, self.config = framer, config
        self.text_field = text_field or config.action_field
        self.observation_text = observation_text
        self.renderer = renderer
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

    def play(self, text: str, completion_ids: Sequence[int]) -> EnvTurn[ActionOutcome]:
        """Play a completion: its ``text`` (decoded without special tokens) goes to the env;
        tool calls are read from its ids decoded with special tokens, where markers such as
        ``[TOOL_CALLS]`` live. A turn: its env calls are yielded (see the module docstring)."""
        config = self.config
        if not config.mcp_tool and config.action_parser is None:  # the text is the action
            step = EnvCall("step", (self.env_text(text),))
            return self._send(step, text_field=self.text_field)
        return self._play_fields(self.env_text(text), completion_ids)

    def _play_fields(self, action: str, completion_ids: Sequence[int]) -> EnvTurn[ActionOutcome]:
        """:meth:`play` for an action sent by its fields (an ``action_parser``'s) or as tool
        calls (``mcp_tool``)."""
        config = self.config
        if not config.mcp_tool:
            try:
                fields = dict(config.action_parser(action))
            except ValueError as exc:  # the parser's refusal: the policy's mistake
                return self._invalid(str(exc) or type(exc).__name__)
            return (yield from self._send(EnvCall("step_action", (fields,))))
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
            arguments: dict[str, Any] = {config.action_field: action}
            if config.action_parser is not None:
                try:
                    arguments = dict(config.action_parser(action))
                except ValueError as exc:
                    return self._invalid(str(exc) or type(exc).__name__)
            return (yield from self._send(EnvCall("call_tool", (config.mcp_tool, arguments))))
        return (yield from self.run_calls(parsed.calls))

    def run_calls(self, calls: Sequence[ToolCall]) -> EnvTurn[ActionOutcome]:
        """Run well-formed tool calls in order (a turn, see the module docstring): the
        rewards add up, a failed call or the episode's end stops the rest, and each result
        goes back in the template's tool role (all in one user message without one)."""
        outcome = ActionOutcome(0.0, {"tool_calls": []})
        texts: list[str] = []
        for index, call in enumerate(calls):
            step = yield from self._send(EnvCall("call_tool", (call.name, call.arguments)))
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
            outcome.observations = [{"role": "user", "content": _joined(texts)}]
        else:
            outcome.observations = [{"role": role, "content": text} for text in texts]
        return outcome

    def _send(self, call: EnvCall, *, text_field: str | None = None) -> EnvTurn[ActionOutcome]:
        """One env call; an env failure never reaches the caller as an exception.

        An action the env's action class refuses is an invalid turn when the refusal is the
        policy's: with the text sent in ``text_field``, only errors of that field's value
        are (a missing or unknown field is the manifest's ``action_field`` not fitting the
        action class: a failure); fields an ``action_parser`` made, or tool arguments, are
        all the policy's.
        """
        try:
            reply: EnvReply = yield call
        except EnvError as exc:
            field_errors = exc.field_errors if isinstance(exc, EnvProtocolError) else None
            if field_errors and _policy_errors(field_errors, text_field):
                return self._invalid(_field_errors_text(field_errors))
            return ActionOutcome(0.0, {"error": f"{type(exc).__name__}: {exc}"})
        info = self.renderer.env_info(reply)
        field_name = self.config.action_error_field
        if field_name:
            error = reply.observation.get(field_name) or reply.metadata.get(field_name)
            if error:
                info["action_error"] = error
        reward = float(reply.reward or 0.0)
        if reply.done:
            return ActionOutcome(reward, info, [{"role": "user", "content": ""}], reply)
        try:
            images = self.renderer.images(reply)
        except ImageObservationError as exc:
            info["error"] = f"{type(exc).__name__}: {exc}"
            return ActionOutcome(reward, info, [], reply)
        roles = None if images or call.method != "step" else self._in_roles(info.get("messages"))
        if roles is not None:
            return ActionOutcome(reward, info, roles, reply)
        content = with_images(self.observation_text(reply), images)
        return ActionOutcome(reward, info, [{"role": "user", "content": content}], reply)

    def _in_roles(self, messages: Any) -> list[dict[str, Any]] | None:
        """A text env's step ``info["messages"]`` in the template's own roles: its tool
        results (``tool`` messages first) as tool messages, the user messages after them as
        one user message. None (the observation text as one user message) without tool
        messages, with a template that has no tool role, or for messages of another shape."""
        if not isinstance(messages, list) or not messages:
            return None
        if not all(_plain_message(m) and m["role"] in ("tool", "user") for m in messages):
            return None
        tools = [m["content"] for m in messages if m["role"] == "tool"]
        users = [m["content"] for m in messages if m["role"] == "user"]
        in_order = all(m["role"] == "tool" for m in messages[: len(tools)])
        if not tools or not in_order or self.framer.observation_role("tool") != "tool":
            return None
        limit = self.config.max_observation_bytes
        shown = [{"role": "tool", "content": cut_observation(text, limit)} for text in tools]
        if users:
            shown.append({"role": "user", "content": cut_observation("\n\n".join(users), limit)})
        return shown

    def _invalid(self, reason: str) -> ActionOutcome:
        """An invalid turn: ``reason`` is what the policy is shown; the env was not stepped."""
        feedback = INVALID_ACTION_FEEDBACK.format(reason=reason)
        return ActionOutcome(
            self.config.invalid_action_reward,
            {"invalid_action": reason},
            [{"role": "user", "content": feedback}],
        )


def cut_observation(text: str, limit: int | None) -> str:
    """``text`` cut to its first ``limit`` bytes of UTF-8 (at a character's end), a note of
    its size appended; as it is when it fits or ``limit`` is None."""
    if limit is None or len(text) <= limit // 4:  # a character is at most 4 bytes
        return text
    data = text.encode("utf-8", errors="surrogatepass")
    if len(data) <= limit:
        return text
    kept = data[:limit].decode("utf-8", errors="ignore")
    return f"{kept}\n[observation cut: {len(data):,} bytes, max_observation_bytes {limit:,}]"


def _policy_errors(field_errors: Sequence[Mapping[str, Any]], text_field: str | None) -> bool:
    """Whether refused fields are the policy's mistake (see :meth:`ActionPlayer._send`)."""
    if text_field is None:
        return True
    return all(
        tuple(error.get("loc") or ())[:1] == (text_field,)
        and error.get("type") not in ("missing", "extra_forbidden")
        for error in field_errors
    )


def _field_errors_text(field_errors: Sequence[Mapping[str, Any]]) -> str:
    """Each invalid field and why, as pydantic names them: ``guess: Input should be ...``."""
    parts = []
    for error in field_errors:
        where = ".".join(str(part) for part in error.get("loc") or ())
        message = str(error.get("msg") or "invalid")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def _plain_message(message: Any) -> bool:
    return (
        isinstance(message, Mapping)
        and isinstance(message.get("role"), str)
        and isinstance(message.get("content"), str)
    )


def _joined(contents: Sequence[Any]) -> Any:
    """Several observations' contents as one message's: the texts joined, after every image
    they show."""
    images = message_images([{"content": content} for content in contents])
    return with_images("\n\n".join(map(content_text, contents)), images)
