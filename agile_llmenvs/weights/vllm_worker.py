"""The worker extension of our vLLM engines and servers (``worker_extension_cls``, named by
:data:`~agile_llmenvs.weights.WORKER_EXTENSION`): the receiving end of a weight sync, run in
the engine's worker process.

vLLM imports this module in each worker before it builds the weight-transfer engine its
config names, so importing it there enters the gloo engine
(:mod:`~agile_llmenvs.weights.vllm_gloo_engine`) in vLLM's registry
(:func:`register_gloo_engine`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from agile_llmenvs.weights.vllm_reload import reprocess_tied_heads

__all__ = ["WeightSyncWorker", "register_gloo_engine"]


class WeightSyncWorker:
    """Mixed into vLLM's worker class (``worker_extension_cls``): the receiving end of
    :meth:`~agile_llmenvs.training.generation.PolicyVLLMEngine.load_weights` and of a
    server's weight sync, run in the engine's worker process."""

    def load_policy_weights(self, payload: bytes) -> int:
        """Reload the model's weights from a safetensors blob of Hugging Face names.

        Returns:
            How many tensors came.
        """
        from safetensors.torch import load

        return self._reload(load(bytes(payload)).items())

    def load_policy_weights_from(self, path: str) -> int:
        """Reload the model's weights from a folder of safetensors files of Hugging Face
        names (what :meth:`~agile_llmenvs.backends.VLLMServerBackend.sync_weights` and
        :class:`~agile_llmenvs.training.generation.ServerWeightSync` write: one file per
        training process, a sharded tensor's rows split over them,
        :mod:`~agile_llmenvs.weights.files`), streamed tensor by tensor; or from one
        safetensors file. A server's ``/collective_rpc`` passes string arguments only.

        Returns:
            How many tensors came.
        """
        from safetensors.torch import load_file

        from agile_llmenvs.weights.files import read_weights

        source = Path(path)
        if source.is_dir():
            return self._reload(read_weights(source))
        return self._reload(load_file(path).items())

    def _reload(self, weights: Iterable[tuple[str, Any]]) -> int:
        worker: Any = self
        count = 0

        def counted() -> Iterator[tuple[str, Any]]:
            nonlocal count
            for item in weights:
                count += 1
                yield item

        worker.reload_weights(weights_iterator=counted())
        reprocess_tied_heads(worker.model_runner.model)
        return count


def register_gloo_engine() -> None:
    """In a vLLM worker (vLLM has been imported), enter the gloo weight-transfer engine in
    vLLM's registry; elsewhere do nothing (vLLM is not imported for it)."""
    import sys

    if "vllm" in sys.modules:
        from agile_llmenvs.weights.vllm_gloo_engine import register

        register()


# vLLM imports this module for the worker extension before it builds the weight-transfer
# engine its config names: the one moment the engine can be registered in its process
register_gloo_engine()
