"""RolloutHarness: token-exact multi-turn rollouts over any env client.

The harness owns tokenisation, the turn loop and the provenance mask. Training data is built
only from ids: the first prompt's, the policy's sampled ids, and the frame and observation ids
the harness inserts. Text is decoded only to send the action to the env, never to rebuild a
past turn.

Every method that talks to the env has a blocking and an async form (``reset`` / ``areset``,
``step`` / ``astep``, ...) over one turn logic that yields its env calls as values (see
:mod:`~agile_llmenvs.llm_envs.actions`); only the driver that performs them differs.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from itertools import repeat
from typing import Any

from agile_llmenvs.core import EpisodeData, SampleImages, StopReason, TurnResult
from agile_llmenvs.errors import EnvProtocolError, EnvStateError
from agile_llmenvs.llm_envs.actions import (
    INVALID_ACTION_FEEDBACK,
    MALFORMED_FEEDBACK,
    ActionPlayer,
    AsyncEnvCalls,
    EnvCall,
    EnvTurn,
    cut_observation,
    drive,
)
from agile_llmenvs.llm_envs.episode_state import EpisodeState
from agile_llmenvs.llm_envs.framing import ChatFramer
from agile_llmenvs.llm_envs.harness_config import HarnessConfig
from agile_llmenvs.llm_envs.image_framing import (
    PromptRenderer,
    content_text,
    message_images,
    with_images,
)
from agile_llmenvs.llm_envs.restart import FittedRestart, TurnText, fit_restart
from agile_llmenvs.transport.client import EnvClientProtocol, InProcessEnvClient, SupportsListTools
from agile_llmenvs.transport.remote import RemoteEnvClient
from agile_llmenvs.transport.types import EnvReply

__all__ = ["INVALID_ACTION_FEEDBACK", "MALFORMED_FEEDBACK", "HarnessConfig", "RolloutHarness"]


class RolloutHarness:
    """Token-level rollout env: tokenisation and the turn loop over a text env client.

    ``reset`` returns the first prompt's ids; ``step`` takes the ids the policy sampled
    (and optionally their log-probs), sends the decoded action to the env and returns the ids
    to append before the next generation; :meth:`get_episode_data` returns the token-exact
    training samples with the provenance mask. :meth:`areset` / :meth:`astep` are the same
    turns with the env calls awaited (a remote env's on the session loop); ``async_calls``
    says how they run a blocking client's calls (a collector sets its own pool there).

    Args:
        env_client: A URL (or a callable returning one) of an OpenEnv server, or any env
            client (:class:`InProcessEnvClient`, :class:`RemoteEnvClient`, ...).
        tokenizer: The policy's Hugging Face tokenizer.
        max_turns: Turns before truncation.
        config: All other settings at once; keyword arguments override its fields.
        **settings: Any :class:`HarnessConfig` field, by name.
    """

    def __init__(
        self,
        env_client: str | Callable[[], str] | EnvClientProtocol,
        tokenizer: Any,
        max_turns: int = 1,
        *,
        config: HarnessConfig | None = None,
        **settings: Any,
    ) -> None:
        self.config = replace(config or HarnessConfig(), max_turns=max_turns, **settings)
        self.tokenizer = tokenizer
        if isinstance(env_client, str) or (
            callable(env_client) and not hasattr(env_client, "reset")
        ):
            env_client = RemoteEnvClient(
                env_client, timeout_s=self.config.timeout_s, action_field=self.config.action_field
            )
        if self.config.action_parser is not None and not (
            self.config.mcp_tool or hasattr(env_client, "step_action")
        ):
            raise ValueError(
                f"action_parser needs a client that sends actions by their fields; "
                f"{type(env_client).__name__} has no step_action"
            )
        self.client: Any = env_client
        processor = self.config.vision_processor
        template_kwargs = dict(self.config.chat_template_kwargs or {})
        if processor is not None:
            if not self.config.apply_chat_template:
                raise ValueError(
                    "vision_processor needs the chat template to place images: drop "
                    "apply_chat_template=False"
                )
            if getattr(processor, "chat_template", None):
                template_kwargs.setdefault("chat_template", processor.chat_template)
        self.framer = ChatFramer(
            tokenizer,
            strict=self.config.strict_chat_template_boundary,
            use_template=self.config.apply_chat_template,
            chat_template_kwargs=template_kwargs,
        )
        self.renderer = PromptRenderer(
            self.framer,
            processor,
            max_images=self.config.segment_max_images,
            image_field=self.config.image_field,
        )
        self.player = ActionPlayer(
            self.framer,
            self._observation_text,
            self.config,
            renderer=self.renderer,
            text_field=getattr(env_client, "action_field", None),  # where the client puts it
        )
        self.async_calls = _ASYNC_CALLS
        self.eval = False
        self._episode: EpisodeState | None = None
        self._tools: list[dict[str, Any]] | None = None  # an MCP env's, listed at first reset

    @classmethod
    def local(cls, env: Any, tokenizer: Any, max_turns: int = 1, **settings: Any) -> RolloutHarness:
        """A harness over an env in this process (no server, no sockets)."""
        client = InProcessEnvClient(env, action_field=settings.get("action_field", "message"))
        return cls(client, tokenizer, max_turns, **settings)

    @classmethod
    def from_spec(cls, spec: Any, tokenizer: Any, **settings: Any) -> RolloutHarness:
        """A harness for a URL, a ``module:Class`` entrypoint, or an ``LLMEnvSpec``: see
        :func:`~agile_llmenvs.llm_envs.from_spec.harness_arguments`."""
        from agile_llmenvs.llm_envs.from_spec import harness_arguments

        env_client, max_turns, merged = harness_arguments(spec, **settings)
        return cls(env_client, tokenizer, max_turns, **merged)

    # -- the episode -------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Whether the current episode has ended (True before the first reset)."""
        return self._episode is None or self._episode.stop_reason is not None

    @property
    def info(self) -> dict[str, Any]:
        """The current episode's info so far (env info plus the harness's keys)."""
        return dict(self._require_episode().info)

    @property
    def turns_played(self) -> int:
        """Turns the current episode has played."""
        return self._require_episode().turn

    @property
    def context_ids(self) -> list[int]:
        """A copy of the current sample's ids: the prompt of the next generation."""
        return list(self._require_episode().ids)

    @property
    def context_images(self) -> SampleImages | None:
        """The images the current sample shows (their tensors beside), None if none: what
        the next generation must be given with :attr:`context_ids`."""
        images = self._require_episode().images
        return images if images.images else None

    def reset(self, *, seed: int | None = None, **task: Any) -> list[int]:
        """Start an episode and return the first prompt's ids.

        ``row_index`` selects an entry of ``tasks`` (``eval_tasks`` in eval mode), merged
        into the env's reset kwargs. When the prompt alone is over ``max_model_len`` the
        episode is already over (``done``, ``StopReason.PROMPT_LIMIT``). An env whose reset
        observation is empty (an MCP env's) is introduced by the tools it lists.
        """
        return drive(self._reset(seed, task), self.client)

    async def areset(self, *, seed: int | None = None, **task: Any) -> list[int]:
        """:meth:`reset` with the env calls awaited (on the session loop for a remote env)."""
        return await self.async_calls.drive(self._reset(seed, task), self.client)

    def step(
        self, completion_ids: Sequence[int], sampling_logps: Sequence[float] | None = None
    ) -> TurnResult:
        """Play one turn with the ids the policy sampled.

        Raises:
            EnvStateError: the episode is over (or was never started).
            ValueError: ``sampling_logps`` does not have one value per sampled id.
        """
        return drive(self._step(completion_ids, sampling_logps), self.client)

    async def astep(
        self, completion_ids: Sequence[int], sampling_logps: Sequence[float] | None = None
    ) -> TurnResult:
        """:meth:`step` with the env calls awaited (on the session loop for a remote env)."""
        return await self.async_calls.drive(self._step(completion_ids, sampling_logps), self.client)

    def _reset(self, seed: int | None, task: dict[str, Any]) -> EnvTurn[list[int]]:
        if task.get("row_index", 0) is None:
            del task["row_index"]
        rows = self.config.eval_tasks if self.eval and self.config.eval_tasks else self.config.tasks
        if rows is not None and task.get("row_index") is not None:
            index = int(task["row_index"])
            if not 0 <= index < len(rows):
                raise IndexError(f"row_index {index} is outside the {len(rows)} tasks")
            task = {**rows[index], **task}
        kwargs = {"seed": seed, **task}
        reply = yield EnvCall("reset", kwargs=kwargs)
        config = self.config
        episode = self._episode = EpisodeState(info=self.renderer.env_info(reply))
        episode.reset_kwargs = kwargs
        if reply.observation or config.observation_processor or config.observation_field:
            text = self._observation_text(reply)
        else:  # an MCP env's empty reset: introduced by its tools
            text = yield from self._first_prompt(reply)
        episode.prompt_text = text
        head = "\n\n".join(filter(None, [config.instruction, text]))
        content = with_images(head, self.renderer.images(reply))
        system = episode.system_prompt = config.system_prompt or _env_system_prompt(episode.info)
        user = {"role": "user", "content": content}
        episode.messages = [{"role": "system", "content": system}, user] if system else [user]
        ids, episode.images = self.renderer.prompt(episode.messages)
        episode.append(ids, turn=None)
        for name in ("max_model_len", "segment_prompt_tokens"):
            limit = getattr(config, name)
            if limit is not None and len(ids) > limit:
                episode.info["prompt_limit"] = {"prompt_tokens": len(ids), name: limit}
                self._finish(StopReason.PROMPT_LIMIT)
                break
        return list(ids)

    def _step(
        self, completion_ids: Sequence[int], sampling_logps: Sequence[float] | None
    ) -> EnvTurn[TurnResult]:
        episode = self._require_episode()
        if episode.stop_reason is not None:
            raise EnvStateError(f"the episode is over ({episode.stop_reason}); call reset()")
        if sampling_logps is not None and len(sampling_logps) != len(completion_ids):
            raise ValueError(
                f"sampling_logps has {len(sampling_logps)} values for "
                f"{len(completion_ids)} sampled ids"
            )
        turn = episode.turn
        episode.append(completion_ids, turn=turn)
        # NaN marks a turn the policy gave no log-probs for, so later turns stay aligned
        if sampling_logps is None:
            episode.logps.extend(repeat(math.nan, len(completion_ids)))
        else:
            episode.logps.extend(map(float, sampling_logps))
        text = self.framer.decode(completion_ids)
        outcome = yield from self.player.play(text, completion_ids)
        reward, info, reply = outcome.reward, outcome.info, outcome.reply
        episode.rewards.append(reward)
        episode.info.update(info)
        if outcome.failed:
            return self._end(StopReason.ENV_ERROR, reward, info)
        if reply is not None and reply.done:
            reason = StopReason.TRUNCATED if reply.truncated else StopReason.TERMINATED
            return self._end(reason, reward, info)
        if episode.turn >= self.config.max_turns:
            return self._end(StopReason.MAX_TURNS, reward, info)
        return self._next_prompt(completion_ids, text, outcome.observations, reward, info)

    def get_episode_data(self) -> EpisodeData:
        """The finished episode's token-exact samples, rewards and stop reason.

        Raises:
            EnvStateError: the episode is still running.
        """
        episode = self._require_episode()
        if episode.stop_reason is None:
            raise EnvStateError("get_episode_data() before the episode ended")
        return EpisodeData(
            tuple(episode.samples), tuple(episode.rewards), episode.stop_reason, dict(episode.info)
        )

    def snapshot(self) -> EpisodeState:
        """A copy of the running episode as it is now: its ids, masks, rewards, messages and
        the texts of the turns played (:attr:`EpisodeState.texts`), to :meth:`branch` from.

        Raises:
            EnvStateError: no episode is running.
        """
        episode = self._require_episode()
        if episode.stop_reason is not None:
            raise EnvStateError(f"the episode is over ({episode.stop_reason}); nothing to copy")
        return copy.deepcopy(episode)

    def branch(self, snapshot: EpisodeState, client: EnvClientProtocol) -> RolloutHarness:
        """A harness that goes on from ``snapshot`` (taken by :meth:`snapshot`) on
        ``client``, an env at that point of the episode (a branch of this harness's env).

        The new harness shares this one's settings, tokenizer and framing; its episode is a
        copy of the snapshot's, so any number of branches go on independently: the
        Monte-Carlo continuations of ``credit: turn_mc``.
        """
        twin = copy.copy(self)
        twin.client = client
        twin._episode = copy.deepcopy(snapshot)
        return twin

    def abort(self, reason: str = "aborted by the caller") -> None:
        """End a running episode early (``StopReason.ABORTED``); its data stays readable."""
        episode = self._require_episode()
        if episode.stop_reason is None:
            episode.info["aborted"] = reason
            self._finish(StopReason.ABORTED)

    def dataset_size(self) -> int:
        """Rows of the env's dataset (0 for a procedural env), from the env's state."""
        return drive(self._dataset_size(), self.client)

    async def adataset_size(self) -> int:
        """:meth:`dataset_size` with the env calls awaited."""
        return await self.async_calls.drive(self._dataset_size(), self.client)

    def _dataset_size(self) -> EnvTurn[int]:
        try:
            state = yield EnvCall("state")
        except EnvStateError:  # a remote session opens on the first reset
            yield EnvCall("reset")
            state = yield EnvCall("state")
        return int(state.get("dataset_size") or 0)

    def eval_mode(self) -> None:
        """Select reset kwargs from ``eval_tasks`` (when given)."""
        self.eval = True

    def train_mode(self) -> None:
        """Select reset kwargs from ``tasks`` again."""
        self.eval = False

    def close(self) -> None:
        """Close the env client."""
        self.client.close()

    async def aclose(self) -> None:
        """:meth:`close` with the env call awaited."""
        await self.async_calls.perform(EnvCall("close"), self.client)

    # -- internals ---------------------------------------------------------------------------

    def _next_prompt(
        self,
        completion_ids: Sequence[int],
        text: str,
        observations: list[dict[str, Any]],
        reward: float,
        info: dict[str, Any],
    ) -> TurnResult:
        episode = self._require_episode()
        observation = "\n\n".join(content_text(m["content"]) for m in observations)
        shown = message_images(observations)
        episode.texts.append(TurnText(episode.prompt_text, self.player.env_text(text)))
        episode.messages += [{"role": "assistant", "content": text}, *observations]
        episode.prompt_text = observation
        config = self.config
        system = bool(episode.system_prompt)
        appended = self.renderer.turn(completion_ids, observations, system=system)
        new_sample = appended is None
        # A template that rewrites earlier turns: the policy sees the template's re-rendering.
        ids, images = self.renderer.prompt(episode.messages) if appended is None else appended
        budget = config.segment_prompt_tokens
        held = len(images) + (0 if new_sample else len(episode.images))
        over_images = config.segment_max_images is not None and held > config.segment_max_images
        held_ids = len(ids) + (0 if new_sample else len(episode.ids))
        over_tokens = budget is not None and held_ids > budget
        if over_tokens or over_images:
            new_sample = True
            fitted, images = self._restart(observation, shown)
            if not fitted.fits:
                episode.info["segment_limit"] = {
                    "restart_prompt_tokens": len(fitted.ids),
                    "segment_prompt_tokens": budget,
                }
                return self._end(StopReason.CONTEXT_LIMIT, reward, info)
            ids, episode.info["restart"] = fitted.ids, fitted.summary
        context = len(ids) if new_sample else len(episode.ids) + len(ids)
        if config.max_model_len is not None and context >= config.max_model_len:
            episode.info["context_limit"] = {
                "context_tokens": context,
                "max_model_len": config.max_model_len,
            }
            return self._end(StopReason.CONTEXT_LIMIT, reward, info)
        if new_sample:
            episode.close_sample()
        episode.append(ids, turn=None)
        episode.images = images if new_sample else episode.images + images
        return TurnResult(list(ids), reward, False, info, new_sample)

    def _restart(self, observation: str, shown: list[Any]) -> tuple[FittedRestart, SampleImages]:
        """The restart prompt fitted within ``segment_prompt_tokens``; it shows the latest
        observation's images (earlier turns stay as text)."""
        config = self.config
        rendered: dict[tuple[int, ...], SampleImages] = {}

        def render(messages: list[dict[str, Any]]) -> list[int]:
            last = messages[-1]
            messages = [*messages[:-1], {**last, "content": with_images(last["content"], shown)}]
            ids, images = self.renderer.prompt(messages)
            rendered[tuple(ids)] = images
            return ids

        episode = self._require_episode()
        fitted = fit_restart(
            episode.texts,
            observation,
            budget=config.segment_prompt_tokens or sys.maxsize,
            render=render,
            keep_turns=config.restart_keep_turns,
            instruction=config.instruction,
            system_prompt=episode.system_prompt,
        )
        return fitted, rendered[tuple(fitted.ids)]

    def _end(self, reason: StopReason, reward: float, info: dict[str, Any]) -> TurnResult:
        self._finish(reason)
        return TurnResult([], reward, True, info)

    def _finish(self, reason: StopReason) -> None:
        episode = self._require_episode()
        episode.stop_reason = reason
        episode.close_sample()

    def _first_prompt(self, reply: EnvReply) -> EnvTurn[str]:
        """The text of an empty reset observation (an MCP env's reset says nothing): the
        tools the env lists, asked once per harness since they come with the env."""
        if self._tools is None:
            self._tools = yield from self._list_tools()
        return _tools_text(self._tools) if self._tools else self._observation_text(reply)

    def _list_tools(self) -> EnvTurn[list[dict[str, Any]]]:
        if not isinstance(self.client, SupportsListTools):
            return []
        try:
            tools: list[dict[str, Any]] = yield EnvCall("list_tools")
            return tools
        except EnvProtocolError:  # not an MCP env: it refused the listing, and has no tools
            return []

    def _observation_text(self, reply: EnvReply) -> str:
        """The text the policy reads of ``reply``, cut at ``max_observation_bytes``."""
        config = self.config
        if config.observation_processor is not None:
            text = str(config.observation_processor(reply.observation))
        elif config.observation_field is not None:
            if config.observation_field not in reply.observation:
                raise KeyError(
                    f"observation_field {config.observation_field!r} is not in the "
                    f"observation; it has {sorted(reply.observation)}"
                )
            text = str(reply.observation[config.observation_field])
        else:
            text = reply.prompt
        return cut_observation(text, config.max_observation_bytes)

    def _require_episode(self) -> EpisodeState:
        if self._episode is None:
            raise EnvStateError("call reset() first")
        return self._episode


def _env_system_prompt(info: Mapping[str, Any]) -> str | None:
    """The system prompt an env gives in its reset ``info["system_prompt"]`` (a string), if
    any: shown in the template's system role when the harness sets none of its own."""
    prompt = info.get("system_prompt")
    return prompt if isinstance(prompt, str) and prompt else None


_ASYNC_CALLS = AsyncEnvCalls()
"""How :meth:`RolloutHarness.astep` runs a blocking client's calls unless told otherwise."""


def _tools_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools an env lists, as the text of its first prompt: each one's name, description
    and JSON input schema."""
    lines = ["Tools you can call:"]
    for tool in tools:
        description = " ".join(str(tool.get("description") or "").split())
        lines.append(f"- {tool['name']}: {description}" if description else f"- {tool['name']}")
        lines.append(f"  input schema: {json.dumps(tool.get('input_schema') or {})}")
    return "\n".join(lines)
