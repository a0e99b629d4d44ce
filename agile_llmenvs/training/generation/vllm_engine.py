"""GRPO rollouts from vLLM engines whose weights follow the policy being trained.

Each training process starts an engine of its own from the manifest's model (TRL's colocate
mode): on GPUs on the process's own device, sharing it with the trainer
(``gpu_memory_utilization``), and asleep while the trainer learns when
``training.vllm.sleep_between_steps`` says so. After every optimizer step the policy's
weights (a LoRA policy's merged in) go to the engine's worker, where vLLM's in-place reload
(``Worker.reload_weights``) loads them, and the prefix cache, which holds keys and values of
the old weights, is reset.

A policy the process holds whole goes to its engine as one safetensors blob. A policy sharded
by FSDP2 is not gathered: every process writes its shard into a shared sync folder
(:func:`~agile_llmenvs.training.generation.server_sync.write_shared_folder`), and each engine
reads the folder, making one whole tensor at a time from the processes' pieces. The engine's
worker side is :class:`~agile_llmenvs.weights.vllm_worker.WeightSyncWorker`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from agile_llmenvs.errors import AgileLLMEnvsError
from agile_llmenvs.specs import RunManifest
from agile_llmenvs.specs.manifest import VLLMGenerationSpec
from agile_llmenvs.training.policy import is_sharded
from agile_llmenvs.weights import WORKER_EXTENSION, local_weights

__all__ = ["PolicyVLLMEngine"]

_SEED_STRIDE = 1 << 16  # requests per generate call, at most, with seeds of their own


class PolicyVLLMEngine:
    """This process's :class:`~agile_llmenvs.backends.VLLMBackend`, plus :meth:`load_weights`
    from the policy.

    Args:
        manifest: The run; its model (path, tokenizer, dtype, length) starts the engine.
        spec: Engine settings (``training.vllm``).
        max_model_len: Longest prompt plus completion.
        rank: This training process.
        num_processes: The run's training processes (each starts an engine).
        device: This process's device; on a GPU the engine starts on it alone.
        weights_dir: Where a sharded policy's sync folders go (every process must reach it);
            ``None``: a temporary folder rank 0 makes.

    Raises:
        OptionalDependencyError: ``vllm`` is not installed.
        AgileLLMEnvsError: ``spec.sleep_between_steps`` where the installed vLLM cannot sleep
            on this machine's device.
    """

    def __init__(
        self,
        manifest: RunManifest,
        spec: VLLMGenerationSpec,
        *,
        max_model_len: int,
        rank: int = 0,
        num_processes: int = 1,
        device: torch.device | None = None,
        weights_dir: Path | None = None,
    ) -> None:
        from agile_llmenvs.backends.vllm import VLLMBackend, VLLMConfig
        from agile_llmenvs.tiny_model import ensure_tiny_model

        model = manifest.model
        extra: dict[str, Any] = {"worker_extension_cls": WORKER_EXTENSION}
        if model.tokenizer_path:
            extra["tokenizer"] = model.tokenizer_path
        if spec.sleep_between_steps:
            _check_sleep_mode()
            extra["enable_sleep_mode"] = True
        config = VLLMConfig(
            dtype=model.dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            enforce_eager=spec.enforce_eager,
            seed=manifest.seed + rank,
            extra=tuple(extra.items()),
        )
        self.rank, self.num_processes = rank, num_processes
        self.sleeps = spec.sleep_between_steps
        self.weights_dir = weights_dir
        self._folder: Path | None = None  # the last sync folder (sharded policies)
        with _only_device(device if num_processes > 1 else None):
            self.backend = VLLMBackend(model.path or ensure_tiny_model(), config=config)

    def load_weights(self, policy: Any) -> None:
        """Copy ``policy``'s current weights into the engine; later generations use them.

        Every process calls it together when the policy is sharded (the processes write the
        sync folder together).
        """
        self.wake_up()
        if is_sharded(policy):
            self._load_shared(policy)
        else:
            from safetensors.torch import save

            weights = {
                name: tensor.to("cpu").contiguous() for name, tensor in local_weights(policy)
            }
            self.backend.llm.collective_rpc("load_policy_weights", args=(save(weights),))
        self.backend.llm.reset_prefix_cache()

    def _load_shared(self, policy: Any) -> None:
        from agile_llmenvs.training.generation.server_sync import write_shared_folder

        proposed = None
        if self.rank == 0:
            import tempfile

            if self.weights_dir is not None:
                self.weights_dir.mkdir(parents=True, exist_ok=True)
            proposed = Path(tempfile.mkdtemp(prefix="engine-sync-", dir=self.weights_dir))
        folder = write_shared_folder(
            policy, proposed, rank=self.rank, world_size=self.num_processes
        )
        self.backend.llm.collective_rpc("load_policy_weights_from", args=(str(folder),))
        torch.distributed.barrier()  # every engine has read it
        if self.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)

    def sleep(self) -> None:
        """Free the engine's device memory for learning (``sleep_between_steps``): the KV
        cache is dropped and the weights move to host memory until :meth:`wake_up`."""
        if self.sleeps:
            self.backend.llm.sleep(level=1)

    def wake_up(self) -> None:
        """Bring a sleeping engine back (a no-op unless ``sleep_between_steps``)."""
        if self.sleeps:
            self.backend.llm.wake_up()

    def close(self) -> None:
        """Shut the engine down."""
        self.backend.close()


def _check_sleep_mode() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_sleep_mode_available():
        raise AgileLLMEnvsError(
            f"training.vllm.sleep_between_steps: the installed vLLM cannot sleep on "
            f"{current_platform.device_name or 'this device'} (sleep mode needs a GPU); "
            "set it to false"
        )


@contextlib.contextmanager
def _only_device(device: torch.device | None) -> Iterator[None]:
    """Start an engine on ``device`` alone: its worker processes see that GPU only (as
    device 0). Nothing changes for a CPU, or for one process."""
    if device is None or device.type != "cuda":
        yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    listed = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    os.environ["CUDA_VISIBLE_DEVICES"] = listed[index]
    try:
        yield
    finally:
        if visible is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
