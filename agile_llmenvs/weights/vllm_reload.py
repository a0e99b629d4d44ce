"""What a vLLM worker does after it reloaded a model's weights in place, whichever way they
came (a file, a folder, a gloo stream)."""

from __future__ import annotations

from typing import Any

__all__ = ["reprocess_tied_heads"]


def reprocess_tied_heads(model: Any) -> None:
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
