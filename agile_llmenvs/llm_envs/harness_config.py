"""HarnessConfig: the settings of a :class:`~agile_llmenvs.llm_envs.harness.RolloutHarness`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agile_llmenvs.llm_envs.tool_calls import TOOL_CALL_PARSERS

__all__ = ["HarnessConfig"]


@dataclass(frozen=True)
class HarnessConfig:
    """Settings of a :class:`RolloutHarness` (the reference's keyword names).

    Attributes:
        max_turns: Turns before the episode is truncated (``StopReason.MAX_TURNS``).
        timeout_s: Per-message timeout of a remote env client.
        mcp_tool: Send actions as calls of this MCP tool; a completion's own tool calls
            (parsed as ``tool_call_parser``) each call the tool they name, in order.
        tool_call_parser: The tool-call format the policy writes: ``hermes`` (Qwen / Hermes
            ``<tool_call>`` JSON), ``llama3_json``, ``mistral`` (``[TOOL_CALLS]``) or
            ``pythonic`` (``[f(x=1)]``).
        strip_reasoning: Send the env the action without its reasoning block (None: on when
            the chat template has one). Training ids keep everything the policy sampled.
        reasoning_delimiters: The reasoning block's open and close (None: the template's,
            ``<think>`` / ``</think>``).
        action_field: Action field (or MCP argument) carrying the text.
        action_parser: Turns the action text into the action's fields (or an MCP tool's
            arguments), instead of putting the text into ``action_field``; a ``ValueError``
            it raises makes the turn invalid, its message the feedback.
        observation_field: Observation field holding the prompt text (None: what
            :attr:`EnvReply.prompt` picks: ``prompt``, an MCP tool's result, or the one
            string field of a structured observation).
        observation_processor: Turns an observation dict into prompt text.
        instruction: Text put before the first observation.
        strict_chat_template_boundary: Raise when the tokenizer has no chat template
            (otherwise frame as ChatML, with a warning).
        apply_chat_template: Frame prompts with the chat template (False: raw text).
        chat_template_kwargs: Extra keyword arguments for the chat template.
        max_model_len: Context budget: an over-long first prompt ends the episode at turn 0
            (``PROMPT_LIMIT``); a later overflow ends it at the last generation
            (``CONTEXT_LIMIT``).
        system_prompt: System message of every prompt (None: the env's reset
            ``info["system_prompt"]`` when it gives one, else none).
        tasks: Per-row reset kwargs; ``reset(row_index=i)`` merges ``tasks[i]``.
        eval_tasks: Held-out per-row reset kwargs used in eval mode.
        segment_prompt_tokens: A bound on every prompt the policy sees: a context that would
            pass it restarts (a new training sample) from a prompt fitted within it (see
            :func:`~agile_llmenvs.llm_envs.restart.fit_restart`); a first prompt over it
            ends the episode at turn 0 (``PROMPT_LIMIT``).
        vision_processor: A vision-language model's processor (``AutoProcessor``): the
            env's images are shown to the policy, framed by the processor's chat template
            with each placeholder expanded as the processor does; each sample keeps its
            images and their tensors (:attr:`TokenSample.images`). None: the policy is
            text-only, and an observation with images fails its episode.
        image_field: The observation field holding an observation's images (None: the
            observation's ``images``, else ``info["images"]``).
        segment_max_images: Images one context may hold: a turn that would pass it restarts
            the context (a new sample) from a prompt showing that turn's images only; an
            observation with more images than this fails its episode.
        restart_keep_turns: Latest turns kept verbatim in a restarted context.
        max_observation_bytes: Most bytes (UTF-8) of an observation's text tokenized: a
            longer one is cut there and a note of its size appended (None: no cap).
        action_error_field: Observation (or info) field where the env reports an invalid
            action; its value is recorded in ``info["action_error"]``.
        malformed_tool_call_reward: Reward of a turn whose tool call could not be parsed.
        invalid_action_reward: Reward of a turn whose action the env's action class (or
            ``action_parser``) refused: the policy is shown which field was wrong and why,
            and the episode goes on.
    """

    max_turns: int = 1
    timeout_s: float | None = None
    mcp_tool: str | None = None
    tool_call_parser: str = "hermes"
    strip_reasoning: bool | None = None
    reasoning_delimiters: tuple[str, str] | None = None
    action_field: str = "message"
    action_parser: Callable[[str], Mapping[str, Any]] | None = None
    observation_field: str | None = None
    observation_processor: Callable[[Any], str] | None = None
    instruction: str = ""
    strict_chat_template_boundary: bool = True
    apply_chat_template: bool = True
    chat_template_kwargs: Mapping[str, Any] | None = None
    max_model_len: int | None = None
    system_prompt: str | None = None
    tasks: Sequence[Mapping[str, Any]] | None = None
    eval_tasks: Sequence[Mapping[str, Any]] | None = None
    segment_prompt_tokens: int | None = None
    segment_max_images: int | None = None
    vision_processor: Any = None
    image_field: str | None = None
    restart_keep_turns: int = 0
    max_observation_bytes: int | None = 1_000_000
    action_error_field: str = ""
    malformed_tool_call_reward: float = 0.0
    invalid_action_reward: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "max_turns",
            "max_model_len",
            "segment_prompt_tokens",
            "segment_max_images",
            "max_observation_bytes",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.restart_keep_turns < 0:
            raise ValueError(f"restart_keep_turns must be >= 0, got {self.restart_keep_turns}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser {self.tool_call_parser!r} is not one of {TOOL_CALL_PARSERS}"
            )
        delimiters = self.reasoning_delimiters
        if delimiters is not None and (len(delimiters) != 2 or not all(delimiters)):
            raise ValueError(
                "reasoning_delimiters must be two non-empty strings (open, close), got "
                f"{delimiters!r}"
            )
