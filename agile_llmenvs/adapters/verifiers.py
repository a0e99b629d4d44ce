"""verifiers environments (``verifiers``, the ``verifiers`` extra) as text envs: ``factory:
agile_llmenvs.adapters.verifiers:make`` with the env as the entrypoint, either an installed
verifiers env id (``vf-math-python``, loaded by ``verifiers.load_environment``) or a
``module:attr`` that is a verifiers env or builds one.

The classic verifiers API is driven: ``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv`` and any
other ``verifiers.Environment`` with a ``rollout(input, client, model)``, with its ``Rubric``.
That API lives in verifiers 0.3.x (under ``verifiers.legacy``, also at its old paths); 0.4
dropped it for a new stack (``verifiers.v1``): with 0.4 installed, :func:`make` builds the
env with :mod:`agile_llmenvs.adapters.verifiers_v1` instead, so one manifest works with either.

How an episode runs: the env's own ``rollout`` coroutine plays the dataset row on one private
event loop per adapter, run in the calling thread, with a client that hands each model call to
the policy.
``reset`` starts the rollout and returns when the env asks the model for the first time;
``step`` answers that call with the policy's text (its tool calls parsed in
``tool_call_parser``'s format) and returns when the env asks again or the rollout ends. Each
of these is bounded by ``call_timeout_s``. The env's rubric scores the finished rollout: the
reward is paid on the terminal step, with the rubric's ``metrics`` in ``info``. A rollout
still under way is cancelled by ``reset`` and ``close`` (its cleanup handlers run), and
``close`` also stops the env's worker threads.

Every observation's messages are in ``info["messages"]`` with their roles (system, user,
tool); the observation text is their contents, the system message left out: it is in the
reset's ``info["system_prompt"]``, which the rollout harness shows in the chat template's
system role (unless the run sets a ``system_prompt`` of its own).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from agile_llmenvs.adapters._verifiers_load import load_verifiers_env
from agile_llmenvs.adapters.episode_loop import (
    Conversation,
    EpisodeLoop,
    message_dict,
    observation_text,
    pick_index,
)
from agile_llmenvs.errors import (
    EnvBuildError,
    EnvExecutionError,
    OptionalDependencyError,
)
from agile_llmenvs.llm_envs.tool_calls import parse_tool_calls

if TYPE_CHECKING:
    from agile_llmenvs.adapters.verifiers_v1 import VerifiersV1Env

__all__ = ["DEFAULT_MAX_TURNS", "VerifiersEnv", "make"]

DEFAULT_MAX_TURNS = 32
"""The turn budget of a verifiers env that sets no ``max_turns`` of its own."""

POLICY_MODEL = "agile-llmenvs-policy"
"""The model name the env's rollout is given (it reaches only this adapter's client)."""


class VerifiersEnv:
    """A classic verifiers ``Environment`` behind the
    :class:`~agile_llmenvs.llm_envs.TextEnv` contract.

    Attributes:
        env: The verifiers env.
        dataset_size: Rows of the split played; ``reset(row_index=i)`` plays row ``i``.
        max_turns: The env's own ``max_turns`` (1 for a ``SingleTurnEnv``), else
            :data:`DEFAULT_MAX_TURNS`.
        tools: The env's tools as JSON-schema function descriptions (``name``,
            ``description``, ``parameters``); empty when it has none.
    """

    def __init__(
        self,
        env: Any,
        *,
        split: str = "train",
        call_timeout_s: float | None = 60.0,
        tool_call_parser: str = "hermes",
    ) -> None:
        self.env = env
        if split not in ("train", "eval"):
            raise EnvBuildError(f"split must be 'train' or 'eval', got {split!r}")
        try:
            rows = env.get_dataset() if split == "train" else env.get_eval_dataset()
        except ValueError as exc:  # verifiers: "dataset is not set"
            raise EnvBuildError(f"the verifiers env has no {split} dataset: {exc}") from exc
        self.rows = rows
        self.dataset_size = len(rows)
        env_turns = int(getattr(env, "max_turns", -1) or -1)
        self.max_turns = env_turns if env_turns > 0 else DEFAULT_MAX_TURNS
        self.tools = [tool.model_dump(exclude_none=True) for tool in env.tool_defs or []]
        self.call_timeout_s = call_timeout_s
        self.tool_call_parser = tool_call_parser
        # the env's sync work (datasets, sync tools) runs on the loop's threads
        self._episodes = EpisodeLoop(call_timeout_s, "verifiers-env")
        self._client = _policy_client()
        self._rollout: Conversation | None = None
        self._closed = False

    def reset(
        self, *, seed: int | None = None, row_index: int | None = None, **task: Any
    ) -> tuple[str, dict[str, Any]]:
        """Start the rollout of row ``row_index`` (else a row drawn by ``seed``, else row 0);
        returns the prompt's text and its messages. Other task keys are ignored.

        Raises:
            RuntimeError: the env is closed.
            IndexError: ``row_index`` is outside the dataset.
            TimeoutError: the env did not ask the model within ``call_timeout_s``.
            EnvExecutionError: the rollout ended before its first model call.
        """
        if self._closed:
            raise RuntimeError("reset() after close()")
        self._cancel_rollout()
        index = pick_index(self.dataset_size, seed, row_index, "rows")
        row = dict(self.rows[index])
        row.setdefault("example_id", index)
        rollout = self.env.rollout(row, self._client, POLICY_MODEL, {})
        self._episodes.start(rollout)
        self._rollout = Conversation(index)
        messages = self._advance()
        if messages is None:
            state = self._finished_state()
            raise EnvExecutionError(
                f"the verifiers rollout of row {index} ended before asking the model "
                f"(stop condition {state.get('stop_condition')!r}, error {state.get('error')!r})"
            )
        return self._rollout.first(messages)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Answer the env's model call with the policy's text; returns the env's reply (its
        new messages), or the rubric's reward and metrics when the rollout is over.

        Raises:
            RuntimeError: no rollout is waiting for the policy (before ``reset``, after the
                end, or after ``close``).
            TimeoutError: the env did not reply, or the rubric did not score, within
                ``call_timeout_s``; the rollout is cancelled.
        """
        pending, rollout = self._client.answer, self._rollout
        if rollout is None or pending is None or pending.done():
            raise RuntimeError("step() before reset() or after the rollout ended")
        pending.set_result(self._response(action))
        messages = self._advance()
        if messages is not None:
            text, info = rollout.next(messages)
            return text, 0.0, False, False, info
        state = self._finished_state()
        self._episodes.run(self._score(state), "scoring the rollout")
        final = list(state.get("final_env_response") or [])
        info = {
            "row_index": rollout.index,
            "metrics": dict(state.get("metrics") or {}),
            "stop_condition": state.get("stop_condition"),
            "messages": [message_dict(m) for m in final],
        }
        if state.get("error") is not None:
            info["error"] = repr(state["error"])
        if state.get("timed_out"):
            info["timed_out"] = True
        return observation_text(final), float(state.get("reward") or 0.0), True, False, info

    def close(self) -> None:
        """Cancel a rollout under way, tear the env down, stop the loop and its threads;
        idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._cancel_rollout()
            self._episodes.wait_all(cancel=True)
        finally:
            self._episodes.close()

    # -- internals ---------------------------------------------------------------------------

    def _advance(self) -> list[Any] | None:
        """Run the rollout until the env asks the model (its prompt messages) or ends (None)."""
        try:
            asked = self._episodes.advance(self._client.expect(self._episodes.loop))
        except TimeoutError:
            self._cancel_rollout()
            raise
        return None if asked is None else list(asked)

    def _finished_state(self) -> Any:
        self._rollout = None
        return self._episodes.finish()  # the env's own failures are in state["error"]

    async def _score(self, state: Any) -> None:
        rubric = self.env.rubric
        if getattr(self.env, "score_rollouts", True):
            await rubric.score_rollout(state)
        else:
            await rubric.dummy_score_rollout(state)
        await rubric.cleanup(state)

    def _cancel_rollout(self) -> None:
        """Cancel the rollout under way, letting its cleanup handlers run."""
        self._rollout = None
        self._client.answer = None
        self._episodes.cancel()

    def _response(self, text: str) -> Any:
        from verifiers.types import Response, ResponseMessage, ToolCall

        calls = []
        if self.tools:
            parsed = parse_tool_calls(text, self.tool_call_parser, reasoning=None)
            # a malformed call is sent as plain text: the env's own rules judge it
            for number, call in enumerate(parsed.calls if parsed.error is None else ()):
                arguments = json.dumps(call.arguments)
                calls.append(ToolCall(id=f"call_{number}", name=call.name, arguments=arguments))
        message = ResponseMessage(
            content=text,
            tool_calls=calls or None,
            finish_reason="tool_calls" if calls else "stop",
            is_truncated=False,
        )
        return Response(
            id=f"policy-{time.monotonic_ns()}",
            created=int(time.time()),
            model=POLICY_MODEL,
            message=message,
        )


class _MainThreadSignals:
    """The ``signal`` module as verifiers' ``Environment`` sees it: it installs SIGINT and
    SIGTERM handlers when built, which Python allows only on the main thread, so elsewhere (an
    env server's session thread, a host's worker) they are skipped."""

    def __getattr__(self, name: str) -> Any:
        return getattr(signal, name)

    def signal(self, signum: int, handler: Any) -> Any:
        if threading.current_thread() is threading.main_thread():
            return signal.signal(signum, handler)
        return signal.getsignal(signum)


def _build_off_the_main_thread(environment_class: type) -> None:
    module = sys.modules.get(environment_class.__module__)
    if module is not None and getattr(module, "signal", None) is signal:
        module.signal = _MainThreadSignals()  # type: ignore[attr-defined]


def _policy_client() -> Any:
    """A verifiers ``Client`` whose model call waits for the policy: ``expect`` arms a future
    that the env's next call resolves with its prompt; ``answer`` is what the call awaits."""
    from verifiers.clients import Client

    class PolicyClient(Client):
        def __init__(self) -> None:
            super().__init__(None)
            self.asked: asyncio.Future[list[Any]] | None = None
            self.answer: asyncio.Future[Any] | None = None

        def expect(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[list[Any]]:
            self.asked = loop.create_future()
            return self.asked

        async def get_response(
            self, prompt: Any, model: str, sampling_args: Any, tools: Any = None, **kwargs: Any
        ) -> Any:
            if self.asked is None or self.asked.done():
                raise RuntimeError("the verifiers env called the model twice in one turn")
            self.answer = asyncio.get_running_loop().create_future()
            self.asked.set_result(list(prompt))
            return await self.answer

        # the abstract hooks of a provider client: never reached, get_response is overridden
        def setup_client(self, config: Any) -> Any:
            return None

        async def to_native_tool(self, tool: Any) -> Any:
            return tool

        async def to_native_prompt(self, messages: Any) -> tuple[Any, dict[str, Any]]:
            return messages, {}

        async def get_native_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

        async def raise_from_native_response(self, response: Any) -> None:
            return None

        async def from_native_response(self, response: Any) -> Any:
            return response

        async def close(self) -> None:
            return None

    return PolicyClient()


def make(
    env_id: str,
    *,
    split: str = "train",
    call_timeout_s: float | None = 60.0,
    tool_call_parser: str = "hermes",
    **kwargs: Any,
) -> VerifiersEnv | VerifiersV1Env:
    """Build verifiers env ``env_id`` as a text env: a :class:`VerifiersEnv` with verifiers
    0.3.x, a :class:`~agile_llmenvs.adapters.verifiers_v1.VerifiersV1Env` with verifiers 0.4
    (``env_id`` a ``module:attr`` of a ``vf.Env`` or a function building one).

    Args:
        env_id: An installed verifiers env id (``verifiers.load_environment(env_id,
            **kwargs)``), or a ``module:attr`` import path of a verifiers env or of a callable
            that builds one from ``kwargs`` (a ``load_environment`` function, say).
        split: The rows played: ``train`` (the env's ``dataset``) or ``eval``.
        call_timeout_s: The longest the env may take between two policy turns (its
            ``env_response``, tools and setup), and to score; None waits forever.
        tool_call_parser: The format of the policy's tool calls (see
            :data:`~agile_llmenvs.llm_envs.tool_calls.TOOL_CALL_PARSERS`).
        **kwargs: The env's own arguments.

    Raises:
        OptionalDependencyError: ``verifiers`` is not installed.
        EnvBuildError: the installed verifiers has neither API, or the env cannot be loaded,
            or is not a verifiers env of the installed API.
    """
    try:
        import verifiers
    except ImportError as exc:
        raise OptionalDependencyError(
            "verifiers", extra="verifiers", feature=f"the verifiers env {env_id!r}"
        ) from exc
    try:
        from verifiers.envs.environment import Environment
    except ImportError as exc:
        if importlib.util.find_spec("verifiers.v1") is not None:  # verifiers 0.4
            from agile_llmenvs.adapters.verifiers_v1 import make_v1

            if split != "train":
                raise EnvBuildError(
                    f"split={split!r}: a verifiers 0.4 env plays its taskset's tasks; pick "
                    "them in the taskset's config"
                ) from exc
            return make_v1(
                env_id, call_timeout_s=call_timeout_s, tool_call_parser=tool_call_parser, **kwargs
            )
        version = getattr(verifiers, "__version__", "?")
        raise EnvBuildError(
            f"verifiers {version} has neither the classic API (verifiers.envs, 0.3.x) nor "
            'verifiers.v1 (0.4): install one, pip install "agile-llmenvs[verifiers]" (0.3.x) '
            'or "agile-llmenvs[verifiers-v1]" (0.4)'
        ) from exc
    _build_off_the_main_thread(Environment)
    env = load_verifiers_env(env_id, kwargs, Environment, installed=verifiers.load_environment)
    if not isinstance(env, Environment):
        preview = sys.modules.get("verifiers.v1")
        if preview is not None and isinstance(env, getattr(preview, "Env", ())):
            raise EnvBuildError(
                f"{env_id!r} gave a verifiers.v1 {type(env).__name__}: the verifiers.v1 preview "
                f"in verifiers {getattr(verifiers, '__version__', '?')} is not driven; install "
                'verifiers 0.4 (pip install "agile-llmenvs[verifiers-v1]")'
            )
        raise EnvBuildError(f"{env_id!r} gave a {type(env).__name__}, not a verifiers Environment")
    return VerifiersEnv(
        env, split=split, call_timeout_s=call_timeout_s, tool_call_parser=tool_call_parser
    )
