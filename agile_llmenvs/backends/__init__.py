"""Generation backends: local (HF, vLLM) over token ids, and API models through their SDKs.

Every backend generates a whole batch of conversations per call (:class:`Backend`); local
ones also generate over token ids and return the sampled ids with their log-probs
(:class:`TokenBackend`). ``vllm``, ``openai`` and ``anthropic`` are imported only when their
backend is built.
"""

from __future__ import annotations

from agile_llmenvs.backends.anthropic_api import AnthropicBackend
from agile_llmenvs.backends.api import APIBackend, APIConfig, RetryPolicy
from agile_llmenvs.backends.hf import HFBackend, HFConfig
from agile_llmenvs.backends.local import LocalChatBackend, parse_tool_calls
from agile_llmenvs.backends.openai_api import OpenAIBackend, OpenRouterBackend
from agile_llmenvs.backends.types import (
    Backend,
    Completion,
    Generation,
    Message,
    Messages,
    SamplingParams,
    TokenBackend,
    TokenDistribution,
    ToolCall,
    Tools,
)
from agile_llmenvs.backends.vllm import VLLMBackend, VLLMConfig
from agile_llmenvs.backends.vllm_server import VLLMServerBackend

__all__ = [
    "APIBackend",
    "APIConfig",
    "AnthropicBackend",
    "Backend",
    "Completion",
    "Generation",
    "HFBackend",
    "HFConfig",
    "LocalChatBackend",
    "Message",
    "Messages",
    "OpenAIBackend",
    "OpenRouterBackend",
    "RetryPolicy",
    "SamplingParams",
    "TokenBackend",
    "TokenDistribution",
    "ToolCall",
    "Tools",
    "VLLMBackend",
    "VLLMConfig",
    "VLLMServerBackend",
    "parse_tool_calls",
]
