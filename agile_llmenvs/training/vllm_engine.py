"""GRPO rollouts from a vLLM engine whose weights follow the policy being trained.

The engine is started from the manifest's model; after every optimizer step the policy's
weights (a LoRA policy's merged in) go to the engine's worker as one safetensors blob, where
vLLM's in-place reload (``Worker.reload_weights``) loads them, and the prefix cache, which
holds keys and values of the old weights, is reset. The blob crosses the engine's own
process boundary, so this suits models that fit one device; sharded engines need a
collective transport instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from agile_llmenvs.errors import AgileLLMEnvsError
from agile_llmenvs.specs import RunManifest
from agile_llmenvs.specs.manifest import VLLMGenerationSpec
from agile_llmenvs.training.lora import merged_weights

__all__ = ["PolicyVLLMEngine", "WeightSyncWorker"]

_EXTENSION = f"{__name__}.WeightSyncWorker"
_SEED_STRIDE = 1 << 16  # requests per generate call, at most, with seeds of their own


class PolicyVLLMEngine:
    """A :class:`~agile_llmenvs.backends.VLLMBackend` plus :meth:`load_weights` from a policy.

    Args:
        manifest: The run; its model (path, tokenizer, dtype, length) starts the engine.
        spec: Engine settings (``training.vllm``).
        max_model_len: Longest prompt plus completion.
        num_processes: The run's training processes; only one is supported.

    Raises:
        OptionalDependencyError: ``vllm`` is not installed.
        AgileLLMEnvsError: more than one training process (each would start an engine on the
            same device).
    """

    def __init__(
        self,
        manifest: RunManifest,
        spec: VLLMGenerationSpec,
        *,
        max_model_len: int,
        num_processes: int = 1,
    ) -> None:
        from agile_llmenvs.backends.vllm import VLLMBackend, VLLMConfig
        from agile_llmenvs.tiny_model import ensure_tiny_model

        if num_processes > 1:
            raise AgileLLMEnvsError(
                f"training.generation_backend 'vllm' runs in a single process, not "
                f"{num_processes}: launch one process, or use generation_backend 'hf'"
            )
        model = manifest.model
        extra: dict[str, Any] = {"worker_extension_cls": _EXTENSION}
        if model.tokenizer_path:
            extra["tokenizer"] = model.tokenizer_path
        config = VLLMConfig(
            dtype=model.dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            enforce_eager=spec.enforce_eager,
            seed=manifest.seed,
            extra=tuple(extra.items()),
        )
        self.backend = VLLMBackend(model.path or ensure_tiny_model(), config=config)

    def load_weights(self, policy: Any) -> None:
        """Copy ``policy``'s current weights into the engine; later generations use them."""
        from safetensors.torch import save

        weights = {
            name: tensor.detach().to("cpu").contiguous()
            for name, tensor in merged_weights(policy).items()
        }
        self.backend.llm.collective_rpc("load_policy_weights", args=(save(weights),))
        self.backend.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down."""
        self.backend.close()


class WeightSyncWorker:
    """Mixed into vLLM's worker class (``worker_extension_cls``): the receiving end of
    :meth:`PolicyVLLMEngine.load_weights`, run in the engine's worker process."""

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
        :class:`~agile_llmenvs.training.server_sync.ServerWeightSync` write: one file per
        training process, a sharded tensor's rows split over them), streamed tensor by
        tensor; or from one safetensors file. A server's ``/collective_rpc`` passes string
        arguments only.

        Returns:
            How many tensors came.
        """
        from safetensors.torch import load_file

        from agile_llmenvs.training.weight_files import read_weights

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
        _reprocess_tied_heads(worker.model_runner.model)
        return count


def _reprocess_tied_heads(model: Any) -> None:
    """Rebuild the kernels of layers that share an earlier layer's weight (a tied ``lm_head``):
    the reload skips their weight, so a layer that prepacks its weight (vLLM's CPU GEMMs do)
    would keep computing with the old one."""
    import torch

    owners: set[int] = set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)
        if not isinstance(weight, torch.Tensor) or method is None or weight.numel() == 0:
            continue
        if weight.data_ptr() in owners:
            method.process_weights_after_loading(module)
        owners.add(weight.data_ptr())
