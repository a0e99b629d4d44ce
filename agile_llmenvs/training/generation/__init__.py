"""What generates the rollouts a run trains on, from the policy being trained: the sampler
over the policy itself, in-process vLLM engines given its weights after every step, and
``vllm serve`` processes that play ahead, with the weight syncs that reach them.

The receiving end of a sync, in a vLLM worker, is :mod:`agile_llmenvs.weights`.
"""

from __future__ import annotations

from agile_llmenvs.training.generation.sampling import Sampler
from agile_llmenvs.training.generation.server_rollouts import Round, ServerRollouts, server_backend
from agile_llmenvs.training.generation.server_sync import (
    ServerWeightSync,
    write_shared_adapters,
    write_shared_folder,
)
from agile_llmenvs.training.generation.vllm_engine import PolicyVLLMEngine

__all__ = [
    "PolicyVLLMEngine",
    "Round",
    "Sampler",
    "ServerRollouts",
    "ServerWeightSync",
    "server_backend",
    "write_shared_adapters",
    "write_shared_folder",
]
