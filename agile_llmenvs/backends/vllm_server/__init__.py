"""Generation from running ``vllm serve`` processes: token ids in, token ids out, over HTTP.

Each request is one ``POST /v1/completions`` with the prompt as token ids; the sampled ids
come back as ``"token_id:N"`` strings with their log-probs (``logprobs: 0`` and
``return_tokens_as_token_ids``), so nothing is decoded and re-encoded. Requests are spread
over several servers, and a server that fails is left out for a while, so only the requests
it held fail.

HTTP goes through ``aiohttp`` (the ``vllm_server`` extra, also in ``api``), on the one event
loop thread remote env sessions use (:data:`~agile_llmenvs.transport.session_loop.SESSION_LOOP`).

* :mod:`.backend` -- :class:`VLLMServerBackend`, which composes the parts below.
* :mod:`.servers` -- the servers: routing, health (down for a while, retired), HTTP calls.
* :mod:`.wire` -- the wire format: the completion request, the reply read back, server info.
* :mod:`.weight_sync` -- weights to the servers: sync folders, LoRA adapters, gloo streams.
"""

from __future__ import annotations

from agile_llmenvs.backends.vllm_server.backend import VLLMServerBackend
from agile_llmenvs.backends.vllm_server.servers import Routing
from agile_llmenvs.backends.vllm_server.weight_sync import SERVED_ADAPTER, LoRASync, WeightTransfer

__all__ = ["SERVED_ADAPTER", "LoRASync", "Routing", "VLLMServerBackend", "WeightTransfer"]
