"""verifiers 0.4 environments (``verifiers.v1``, the ``verifiers-v1`` extra) as text envs:
``factory: agile_llmenvs.adapters.verifiers:make`` dispatches here when the installed
verifiers is 0.4, with the env as the entrypoint: a ``module:attr`` that is a ``vf.Env``
(``vf.SingleAgentEnv`` over a taskset, or an ``Env`` subclass) or builds one.

How an episode runs: the env's own ``run_episode`` plays the task on one private event loop
per adapter, run in the calling thread, exactly as ``vf eval`` would run it: the env's
serving resources (its interception server, its shared tools), the agent's runtime and
harness program, the task's hooks and the task's ``@reward``/``@metric`` scoring. The one
part replaced is the model: v1 sends every model call of a harness program to its
interception server, which asks the rollout's model ``Client``; here that client is the
policy (:class:`PolicyClient`, a ``vf.Client``). The episode's model context names the train
client config (the trainer generates, as with ``TrainClient``), so every call, streamed or
not, reaches ``Client.get_response``.

``reset`` starts the episode and returns when the harness asks the model for the first time;
``step`` answers that call with the policy's text (its tool calls parsed in
``tool_call_parser``'s format) and returns when the harness asks again or the episode ends,
each bounded by ``call_timeout_s``. The reward is paid on the terminal step: the trainable
traces' reward (the sum of their weighted ``@reward`` values), with every named reward and
metric in ``info``. An episode under way is cancelled by ``reset`` and ``close`` (its runtime,
harness program and servers torn down), and ``close`` stops the env's serving resources and
joins the loop's threads.

The ``null`` and ``bash`` harnesses run verifiers' own chat program. verifiers prepares it
with ``uv sync --script`` (downloading its dependencies); here it runs on this interpreter,
which has them (``openai``, ``mcp``, ``httpx``, ``httpx2``, ``tenacity``, ``certifi``: the
``verifiers-v1`` extra installs them), so nothing is downloaded. Harnesses that install a
third-party agent (``claude_code``, ``codex``, ...) or need a container are not driven:
they download their program and need Docker or a sandbox provider.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import importlib.util
import json
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agile_llmenvs.adapters._verifiers_load import load_verifiers_env
from agile_llmenvs.adapters.episode_loop import (
    Conversation,
    EpisodeLoop,
    pick_index,
)
from agile_llmenvs.errors import EnvBuildError, EnvExecutionError
from agile_llmenvs.llm_envs.tool_calls import parse_tool_calls

__all__ = ["DEFAULT_MAX_TURNS", "POLICY_MODEL", "VerifiersV1Env", "make_v1"]

DEFAULT_MAX_TURNS = 32
"""The turn budget when the env's agents set no ``max_turns`` of their own."""

POLICY_MODEL = "agile-llmenvs-policy"
"""The model name of the episode's model context (it reaches only the policy client)."""

REAP_TIMEOUT_S = 5.0
"""How long ``close`` lets killed harness programs be reaped before closing the loop."""

CHAT_PROGRAM_PACKAGES = ("openai", "mcp", "httpx", "httpx2", "tenacity", "certifi")
"""What verifiers' chat program (the ``null`` and ``bash`` harnesses) imports."""


class VerifiersV1Env:
    """A verifiers 0.4 ``vf.Env`` behind the :class:`~agile_llmenvs.llm_envs.TextEnv`
    contract.

    Attributes:
        env: The verifiers env.
        tasks: The taskset's tasks (in ``load()`` order); ``reset(row_index=i)`` plays
            task ``i``.
        dataset_size: How many tasks there are.
        max_turns: The env's agent's ``max_turns``, else :data:`DEFAULT_MAX_TURNS`.
        tools: The tools of the harness's last model call as JSON-schema function
            descriptions (``name``, ``description``, ``parameters``); empty before the
            first call or when it offers none.
    """

    def __init__(
        self,
        env: Any,
        *,
        call_timeout_s: float | None = 60.0,
        tool_call_parser: str = "hermes",
    ) -> None:
        import verifiers.v1 as vf

        version = importlib.metadata.version("verifiers")
        if tuple(int(part) for part in version.split(".")[:2]) < (0, 4):
            raise EnvBuildError(
                f"verifiers {version}'s verifiers.v1 is a preview this adapter does not drive: "
                'install verifiers 0.4 (pip install "agile-llmenvs[verifiers-v1]")'
            )
        if not isinstance(env, vf.Env):
            raise EnvBuildError(f"expected a verifiers.v1 Env, got {type(env).__name__}")
        self.env = env
        if not env.taskset.bounded:
            raise EnvBuildError("the verifiers taskset is infinite: bound it (take, include)")
        if not env._runs_local():
            raise EnvBuildError(
                "the verifiers env's agents run in a remote runtime (the default is Prime's "
                "sandboxes), which needs a sandbox provider's account and a tunnel: set each "
                "agent's runtime to a local one (vf.AgentConfig(runtime={'type': 'subprocess'}))"
            )
        seats = sorted(env._agent_specs)
        if len(seats) > 1:
            raise EnvBuildError(
                f"the verifiers env has {len(seats)} agents ({', '.join(seats)}): every agent's "
                "model calls would reach the one policy (a simulated user, a judge need a model "
                "of their own); only single-agent envs are driven"
            )
        self.tasks = list(env.taskset)
        self.dataset_size = len(self.tasks)
        turns = env._agent_specs[seats[0]].max_turns
        self.max_turns = turns if turns else DEFAULT_MAX_TURNS
        self.tools: list[dict[str, Any]] = []
        self.call_timeout_s = call_timeout_s
        self.tool_call_parser = tool_call_parser
        _prepare_chat_program()
        # the loop's sync work (address lookups, file writes) runs on its threads
        self._episodes = EpisodeLoop(call_timeout_s, "verifiers-v1")
        self._loop = self._episodes.loop
        self._client = _policy_client(self)
        self._context = vf.ModelContext(model=POLICY_MODEL, client=vf.TrainClientConfig())
        self._serving: asyncio.Task[None] | None = None
        self._stop_serving: asyncio.Future[None] | None = None
        self._episode: Conversation | None = None
        self._calls = 0
        self._closed = False

    def reset(
        self, *, seed: int | None = None, row_index: int | None = None, **task: Any
    ) -> tuple[str, dict[str, Any]]:
        """Start the episode of task ``row_index`` (else one drawn by ``seed``, else task
        0); returns the prompt's text and its messages. Other task keys are ignored.

        Raises:
            RuntimeError: the env is closed.
            IndexError: ``row_index`` is outside the taskset.
            TimeoutError: the harness did not ask the model within ``call_timeout_s``.
            EnvExecutionError: the episode ended before its first model call.
        """
        if self._closed:
            raise RuntimeError("reset() after close()")
        self._cancel_episode()
        self._serve()
        index = pick_index(self.dataset_size, seed, row_index, "tasks")
        episode = self.env.run_episode(self.tasks[index], self._context)
        self._episodes.start(episode)
        self._episode = Conversation(index)
        messages = self._advance()
        if messages is None:
            errors = _errors(self._finished())
            raise EnvExecutionError(
                f"the verifiers episode of task {index} ended before asking the model: {errors}"
            )
        text, info = self._episode.first(messages)
        return text, info | {"tools": list(self.tools)}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Answer the harness's model call with the policy's text; returns the messages
        added since (tool results, the user's next turn), or the reward when the episode is
        over.

        Raises:
            RuntimeError: no model call is waiting for the policy (before ``reset``, after
                the end, or after ``close``).
            TimeoutError: the env did not ask again or end within ``call_timeout_s``; the
                episode is cancelled.
        """
        pending, episode = self._client.answer, self._episode
        if episode is None or pending is None or pending.done():
            raise RuntimeError("step() before reset() or after the episode ended")
        pending.set_result(action)
        messages = self._advance()
        if messages is not None:
            text, info = episode.next(messages)
            return text, 0.0, False, False, info
        done = self._finished()
        trained = [t for t in done.traces if t.agent is None or t.agent.trainable]
        rewards: dict[str, float] = {}
        metrics: dict[str, float] = {}
        for trace in trained:
            rewards |= {k: r.value for k, r in trace.rewards.items() if r is not None}
            metrics |= {k: v for k, v in trace.metrics.items() if v is not None}
        info = {
            "row_index": episode.index,
            "rewards": rewards,
            "metrics": metrics,
            "stop_condition": trained[-1].stop_condition if trained else None,
            "num_turns": sum(t.num_turns for t in trained),
            "messages": [],
        }
        errors = _errors(done)
        if errors:
            info["errors"] = errors
        if done.is_timeout or any(t.is_timeout for t in done.traces):
            info["timed_out"] = True
        reward = float(sum(t.reward for t in trained))
        return "", reward, True, False, info

    def close(self) -> None:
        """Cancel an episode under way, stop the env's serving resources, the loop and its
        threads; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._cancel_episode()
            if self._stop_serving is not None and not self._stop_serving.done():
                self._stop_serving.set_result(None)
            self._episodes.wait_all(cancel=False)  # serving() winds down
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            self._reap_programs()
        finally:
            self._episodes.close()

    # -- internals ---------------------------------------------------------------------------

    def _serve(self) -> None:
        """Enter the env's ``serving()`` (its shared tools, ``start()``) in a task of its
        own, with an interception server whose model client is the policy."""
        if self._serving is not None and not self._serving.done():
            return
        ready: asyncio.Future[None] = self._loop.create_future()
        self._stop_serving = self._loop.create_future()
        self._serving = self._loop.create_task(self._hold_serving(ready, self._stop_serving))
        self._episodes.run(asyncio.shield(ready), "starting the verifiers env")

    async def _hold_serving(self, ready: asyncio.Future[None], stop: asyncio.Future[None]) -> None:
        env = self.env
        try:
            async with env.serving():
                secrets = tuple(
                    s.state_secret for s in env._shared_tools.values() if s.state_secret
                )
                async with _policy_interception(self._client, secrets) as interception:
                    # rollouts borrow the env's interception: the policy's replaces the one
                    # serving() made (a lazy pool, never acquired, stopped on exit)
                    env._interception = interception
                    ready.set_result(None)
                    await stop
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    def _advance(self) -> list[Any] | None:
        """Run the episode until the harness asks the model (its prompt) or it ends (None)."""
        try:
            asked = self._episodes.advance(self._client.expect(self._loop))
        except TimeoutError:
            self._cancel_episode()
            raise
        return None if asked is None else list(asked)

    def _finished(self) -> Any:
        self._episode = None
        self._client.answer = None
        return self._episodes.finish()  # the env's own failures: on the episode, its traces

    def _cancel_episode(self) -> None:
        """Cancel the episode under way: its runtime and harness program are torn down."""
        self._episode = None
        answer, self._client.answer = self._client.answer, None
        if answer is not None and not answer.done():
            answer.cancel()
        self._episodes.cancel()

    def _reap_programs(self) -> None:
        """Let the harness programs a cancelled episode killed be reaped, and their pipes
        closed, before the loop closes (Python 3.11 reaps each child on a ``waitpid-``
        thread that reports back to the loop)."""
        deadline = time.monotonic() + REAP_TIMEOUT_S
        while time.monotonic() < deadline and any(
            thread.name.startswith("waitpid-") for thread in threading.enumerate()
        ):
            self._loop.run_until_complete(asyncio.sleep(0.01))
        self._loop.run_until_complete(asyncio.sleep(0.05))  # their exit callbacks, pipes

    def _asked(self, prompt: Sequence[Any], tools: Sequence[Any] | None) -> None:
        self.tools = [_tool_dict(tool) for tool in tools or ()]

    def _response(self, text: str, model: str) -> Any:
        import verifiers.v1 as vf
        from verifiers.v1.clients.train import serialize_completion

        calls = []
        if self.tools:
            parsed = parse_tool_calls(text, self.tool_call_parser, reasoning=None)
            # a malformed call is sent as plain text: the harness's own rules judge it
            for call in parsed.calls if parsed.error is None else ():
                self._calls += 1
                arguments = json.dumps(call.arguments)
                calls.append(
                    vf.ToolCall(id=f"call_{self._calls}", name=call.name, arguments=arguments)
                )
        response = vf.Response(
            id=f"policy-{time.monotonic_ns()}",
            created=int(time.time()),
            model=model,
            message=vf.AssistantMessage(content=text, tool_calls=calls or None),
            finish_reason="tool_calls" if calls else "stop",
        )
        response.raw = serialize_completion(response, model)
        return response


def _prepare_chat_program() -> None:
    """Have the ``null``/``bash`` harnesses' chat program run on this interpreter: the
    subprocess runtime's prepared-script cache (shared by its runtimes) maps the program to
    it, as ``uv sync --script`` would map it to an environment it built."""
    missing = [name for name in CHAT_PROGRAM_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise EnvBuildError(
            f"verifiers' chat program needs {missing} on this interpreter: "
            'pip install "agile-llmenvs[verifiers-v1]"'
        )
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    if not path.exists() or path.read_bytes() != data:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    SubprocessRuntime._interpreters[str(path)] = sys.executable


def _policy_interception(client: Any, state_secrets: tuple[str, ...]) -> Any:
    """An interception server (loopback, no tunnel) whose model client is ``client``."""
    from verifiers.v1.interception import InterceptionServer

    class PolicyInterception(InterceptionServer):
        def _client(self, config: Any) -> Any:
            return client

    return PolicyInterception(state_service_secrets=state_secrets)


def _policy_client(adapter: VerifiersV1Env) -> Any:
    """A ``vf.Client`` whose model call waits for the policy: ``expect`` arms a future
    that the harness's next call resolves with its prompt; ``answer`` is the policy's text
    that the call awaits."""
    import verifiers.v1 as vf

    class PolicyClient(vf.Client):
        def __init__(self) -> None:
            self.asked: asyncio.Future[list[Any]] | None = None
            self.answer: asyncio.Future[str] | None = None

        def expect(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[list[Any]]:
            self.asked = loop.create_future()
            return self.asked

        async def get_response(
            self,
            dialect: Any,
            body: dict[str, Any],
            sampling: Any,
            session_id: str | None = None,
            turn: Any = None,
            headers: Mapping[str, str] | None = None,
        ) -> Any:
            if turn is not None:
                prompt, tools = list(turn.prompt), turn.tools
            else:
                request = dialect.parse_request(body)
                prompt, tools = list(request.messages), request.tools
            if self.asked is None or self.asked.done():
                raise RuntimeError("the verifiers env called the model twice in one turn")
            self.answer = asyncio.get_running_loop().create_future()
            adapter._asked(prompt, tools)
            self.asked.set_result(prompt)
            text = await self.answer
            return adapter._response(text, str(body.get("model") or POLICY_MODEL))

    return PolicyClient()


def _errors(done: Any) -> list[str]:
    """An ended episode's errors and its traces', as ``type: message`` lines."""
    found = [*done.errors, *(e for trace in done.traces for e in trace.errors)]
    return [f"{e.type}: {e.message}" for e in found]


def _tool_dict(tool: Any) -> dict[str, Any]:
    found = {"name": tool.name, "description": tool.description or ""}
    found["parameters"] = tool.parameters or {"type": "object", "properties": {}}
    return found


def make_v1(
    env_id: str,
    *,
    call_timeout_s: float | None = 60.0,
    tool_call_parser: str = "hermes",
    **kwargs: Any,
) -> VerifiersV1Env:
    """Build verifiers 0.4 env ``env_id`` as a text env.

    Args:
        env_id: A ``module:attr`` import path of a ``vf.Env`` or of a callable that builds
            one from ``kwargs``.
        call_timeout_s: The longest the env may take between two policy turns (its
            harness, tools, user turns) and to score; None waits forever.
        tool_call_parser: The format of the policy's tool calls (see
            :data:`~agile_llmenvs.llm_envs.tool_calls.TOOL_CALL_PARSERS`).
        **kwargs: The env's own arguments.

    Raises:
        EnvBuildError: the env cannot be loaded or is not a ``vf.Env``.
    """
    import verifiers.v1 as vf

    if ":" not in env_id:
        raise EnvBuildError(
            f"a verifiers 0.4 env is a module:attr (a vf.Env or a function building one), "
            f"got {env_id!r}"
        )
    env = load_verifiers_env(env_id, kwargs, vf.Env)
    if not isinstance(env, vf.Env):
        raise EnvBuildError(f"{env_id!r} gave a {type(env).__name__}, not a verifiers.v1 Env")
    return VerifiersV1Env(env, call_timeout_s=call_timeout_s, tool_call_parser=tool_call_parser)
