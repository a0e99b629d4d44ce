"""A policy's weights as a folder of safetensors files that generation servers reload.

Every training process writes one file of the folder, ``rank-R-of-W.safetensors``, holding
what it holds: a policy sharded by FSDP2 (``Shard(0)`` on every parameter) leaves the local
rows of each tensor in each process's file, and a tensor is whole again when its pieces are
concatenated along dim 0 in rank order; a policy every process holds whole (one process, or
data parallel) is written by rank 0, and the other processes write files with no tensors, so
a reader can tell the folder is complete. Nothing is gathered: a sync of a sharded policy
costs each process its own shard's bytes.

Files are written tensor by tensor in chunks of at most ``chunk_bytes`` (the safetensors
format laid out by hand, since ``safetensors.torch.save_file`` copies every tensor into bytes
before writing), so a sync holds no second copy of the weights in memory: on a CPU the
parameters' own storage is written, on a GPU one chunk at a time is copied to the host.
:func:`read_weights` yields whole tensors one at a time from memory-mapped files, for vLLM's
``reload_weights(weights_iterator=...)``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from agile_llmenvs.weights.adapters import (
    ADAPTER,
    adapted_layers,
    is_lora,
    require_syncable,
)

__all__ = ["local_weights", "rank_file", "read_weights", "weight_metas", "write_weights"]

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_CHUNK_BYTES = 16 << 20


def rank_file(folder: Path, rank: int, world_size: int) -> Path:
    """The file process ``rank`` of ``world_size`` writes in ``folder``."""
    return folder / f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def local_weights(model: Any, *, whole: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``model``'s weights under the Hugging Face names a server loads, as this process holds
    them: whole tensors, or the local rows of an FSDP2-sharded one (``whole``: gathered whole,
    one at a time). A LoRA model's adapted weights come with their adapters merged in
    (``W + scale * B A``; an embedding's ``W + scale * (B A)^T``), the model untouched.

    Every process of a sharded model must iterate it to the end, in step: a LoRA layer's
    ``A`` is gathered whole (it is small: rank x in-features), a collective, and so is every
    tensor with ``whole``.

    Raises:
        LoRASyncError: A LoRA model whose adapters cannot be merged exactly
            (:func:`~agile_llmenvs.weights.adapters.lora_sync_problems`).
    """
    piece = _whole if whole else _local
    if not is_lora(model):
        for name, param in model.named_parameters():
            yield name, piece(param.detach())
        return
    require_syncable(model)
    yield from _merged_lora_weights(model, piece)


def weight_metas(model: Any) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The name, dtype and whole shape of each tensor :func:`local_weights` yields, in its
    order, without gathering anything."""
    if not is_lora(model):
        return [(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]
    return [
        (name.replace(".base_layer.", "."), param.dtype, tuple(param.shape))
        for name, param in model.get_base_model().named_parameters()
        if ".lora_" not in name
    ]


def _merged_lora_weights(model: Any, piece: Any) -> Iterator[tuple[str, torch.Tensor]]:
    base = model.get_base_model()
    adapted = adapted_layers(base)
    for name, param in base.named_parameters():
        if ".lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")
        layer = adapted.get(name)
        if layer is None:
            yield name, piece(param.detach())
            continue
        with torch.no_grad():
            yield name, _merged(layer, param.detach(), piece)


def _merged(layer: Any, param: torch.Tensor, piece: Any) -> torch.Tensor:
    """This process's rows of the base weight ``param`` plus the same rows of the adapter's
    delta: ``scale * B A`` for a linear layer, ``scale * (B A)^T`` for an embedding (a layer
    :func:`local_weights` has checked with ``require_syncable``)."""
    weight = piece(param)
    scale = layer.scaling[ADAPTER]
    if ADAPTER in layer.lora_A:  # Linear: out x in, rows are B's rows
        lora_a = _whole(layer.lora_A[ADAPTER].weight.detach())
        lora_b = piece(layer.lora_B[ADAPTER].weight.detach())
        return weight + ((lora_b @ lora_a) * scale).to(weight.dtype)
    # Embedding: vocab x dim; A is r x vocab, B is dim x r (both small: gathered whole)
    lora_a = _whole(layer.lora_embedding_A[ADAPTER].detach())
    lora_b = _whole(layer.lora_embedding_B[ADAPTER].detach())
    start = _row_offset(param) if piece is _local else 0
    rows_a = lora_a[:, start : start + weight.shape[0]]
    return weight + ((rows_a.T @ lora_b.T) * scale).to(weight.dtype)


def _row_offset(param: torch.Tensor) -> int:
    """The first row of the whole tensor this process holds of an FSDP2 parameter."""
    if not _is_dtensor(param):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(
        param.shape,
        param.device_mesh,  # type: ignore[attr-defined]
        param.placements,  # type: ignore[attr-defined]
    )
    return int(offset[0])


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """An FSDP2 parameter gathered whole (a collective), or the tensor itself."""
    return tensor.full_tensor() if _is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's rows of an FSDP2 parameter (``Shard(0)``), or the tensor itself."""
    if not _is_dtensor(tensor):
        return tensor
    placements = tensor.placements  # type: ignore[attr-defined]
    if any(not p.is_shard(dim=0) for p in placements):
        raise NotImplementedError(
            f"a parameter is placed {placements}: a weight sync writes FSDP2's dim-0 shards "
            "only (fully_shard's default)"
        )
    return tensor.to_local()  # type: ignore[attr-defined]


def write_weights(
    folder: Path,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    rank: int = 0,
    world_size: int = 1,
    sharded: bool = False,
    chunk_bytes: int = _CHUNK_BYTES,
) -> Path:
    """Write this process's file of ``folder`` and return its path.

    Args:
        folder: The sync's folder (created if missing).
        weights: ``(name, tensor)`` pairs, as :func:`local_weights` yields them.
        rank: This process.
        world_size: Processes writing the folder.
        sharded: The tensors are this process's shards; otherwise every process holds them
            whole and only rank 0 writes them.
        chunk_bytes: Most bytes copied to the host at once.

    The file appears under its name only once it is complete (written as ``.partial``).
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = rank_file(folder, rank, world_size)
    keep = sharded or rank == 0
    # the header needs every tensor's size up front; the tensors themselves are views
    tensors = [(name, tensor) for name, tensor in weights if keep]
    header: dict[str, Any] = {"__metadata__": {"rank": str(rank), "world_size": str(world_size)}}
    offset = 0
    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _dtype_name(name, tensor),
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    partial = path.with_suffix(".partial")
    with partial.open("wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for _, tensor in tensors:
            _write_tensor(out, tensor, chunk_bytes)
    partial.replace(path)
    return path


def _dtype_name(name: str, tensor: torch.Tensor) -> str:
    try:
        return _DTYPES[tensor.dtype]
    except KeyError:
        raise TypeError(f"{name}: dtype {tensor.dtype} has no safetensors name here") from None


def _write_tensor(out: Any, tensor: torch.Tensor, chunk_bytes: int) -> None:
    if tensor.numel() == 0:
        return
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    for start in range(0, flat.numel(), chunk_bytes):
        chunk = flat[start : start + chunk_bytes]
        out.write(chunk.cpu().numpy().data)  # the bytes in place, no copy


def read_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole tensors of a folder :func:`write_weights` wrote, one at a time.

    Raises:
        FileNotFoundError: ``folder`` holds no rank files, or not every process's.
    """
    from safetensors import safe_open

    files = sorted(folder.glob("rank-*-of-*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no rank-*-of-*.safetensors weight files")
    world_size = int(files[0].name.split("-of-")[1].split(".")[0])
    expected = [rank_file(folder, rank, world_size) for rank in range(world_size)]
    missing = [p.name for p in expected if not p.exists()]
    if missing:
        raise FileNotFoundError(f"{folder} is missing {', '.join(missing)}")
    handles = [safe_open(str(p), framework="pt") for p in expected]
    holders: dict[str, list[Any]] = {}
    for handle in handles:
        for name in handle.keys():  # noqa: SIM118 (a safe_open handle is no dict)
            holders.setdefault(name, []).append(handle)
    for name, held_by in holders.items():
        pieces = [h.get_tensor(name) for h in held_by]
        yield name, pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
