"""What a causal LM's forward does to its output layer's logits, found once by a probe.

Some families change the logits after ``lm_head``: Gemma 2 / 3 / 3n / 4, VaultGemma,
RecurrentGemma, xLSTM and nanochat soft-cap them (``c * tanh(x / c)``), Granite divides them by
``logits_scaling``, HyperCLOVA X multiplies them by it, Cohere multiplies them by
``logit_scale``. The scored path applies the output layer itself, a chunk at a time, so it
must apply the same transform, or it trains on other log-probs than the sampler's.

The transform is read from the data, not trusted from attribute names (the same name means a
division in one family and a product in another): one forward of a short input catches the
output layer's own logits ``y`` and the forward's logits ``z``, fits ``z = cap(s * y)`` with the
soft cap ``cap`` (if any) from the config and the scale ``s`` snapped to a config value when
one fits, and checks that the fit reproduces ``z`` to the dtype's precision. A model whose
logits it does not reproduce is refused with :class:`~agile_llmenvs.errors.LogitTransformError`.

A config may name a soft cap its forward does not apply, and logits far below the cap are
nearly linear under it: when the probe's logits fit both the capped and the plain transform,
it probes again with the output layer's logits multiplied (by a forward hook) until the
largest is twice the cap, where the two differ by a quarter of it; a model for which even that
cannot decide is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from agile_llmenvs.errors import LogitTransformError

__all__ = ["LogitTransform", "probe_logit_transform"]

#: Config fields holding a soft cap of the final logits, by family.
SOFTCAP_FIELDS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
#: Config fields holding a factor (or a divisor) of the final logits, by family.
SCALE_FIELDS = ("logit_scale", "logits_scaling", "output_multiplier", "logits_mup_width_multiplier")

_PROBE_TOKENS = 8
_CACHE_ATTRIBUTE = "_agile_llmenvs_logit_transform"


@dataclass(frozen=True)
class LogitTransform:
    """``z = softcap * tanh(scale * y / softcap)``, or ``scale * y`` without a soft cap.

    Attributes:
        scale: Factor of the output layer's logits.
        softcap: The tanh soft cap applied after the scale (None: none).
    """

    scale: float = 1.0
    softcap: float | None = None

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def apply_(self, logits_NV: torch.Tensor) -> torch.Tensor:
        """The transformed logits, computed in place over ``logits_NV``."""
        if self.scale != 1.0:
            logits_NV.mul_(self.scale)
        if self.softcap is not None:
            logits_NV.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits_NV

    def slope(self, transformed_NV: torch.Tensor) -> torch.Tensor | float:
        """``dz / dy`` at the transformed logits ``z`` (a tensor only with a soft cap)."""
        if self.softcap is None:
            return self.scale
        capped_NV = transformed_NV / self.softcap
        return capped_NV.mul_(capped_NV).neg_().add_(1.0).mul_(self.scale)

    def __str__(self) -> str:
        scaled = "y" if self.scale == 1.0 else f"{self.scale:.6g} * y"
        if self.softcap is None:
            return f"z = {scaled}"
        return f"z = {self.softcap:g} * tanh({scaled} / {self.softcap:g})"


def probe_logit_transform(model: Any, hf_model: Any, device: torch.device) -> LogitTransform:
    """The transform of ``hf_model``'s forward after its output layer, probed once and cached.

    The probe is one forward of ``model`` (the wrapper the caller trains: under FSDP it is a
    collective, so every process must call this, as every process scores).

    Args:
        model: ``hf_model`` as the training loop calls it (DDP, FSDP, peft wrappers).
        hf_model: The Hugging Face causal LM inside.
        device: Where the model's inputs live.

    Raises:
        LogitTransformError: The output layer and a scale and soft cap do not reproduce the
            forward's logits.
    """
    cached = hf_model.__dict__.get(_CACHE_ATTRIBUTE)
    if cached is not None:
        return cached
    head_logits, forward_logits = _probe_logits(model, hf_model, device)
    fits = _fit(hf_model, head_logits, forward_logits)
    if len(fits) == 1:
        transform = fits[0]
    else:
        transform = _widened_fit(model, hf_model, device, head_logits, *fits)
    hf_model.__dict__[_CACHE_ATTRIBUTE] = transform
    return transform


def _widened_fit(
    model: Any,
    hf_model: Any,
    device: torch.device,
    head_logits: torch.Tensor,
    capped: LogitTransform,
    plain: LogitTransform,
) -> LogitTransform:
    """The transform, when the probe's logits fit both ``capped`` and ``plain``: from a second
    probe whose output-layer logits are multiplied so that the largest, scaled, is twice the
    cap (``cap(2c) = 0.96c``: capped and plain differ there by ``1.04c``).

    Raises:
        LogitTransformError: the logits are all 0, or even the second probe cannot decide.
    """
    assert capped.softcap is not None
    softcap, name = capped.softcap, type(hf_model).__name__
    largest = abs(plain.scale) * head_logits.double().abs().max().item()
    fits: list[LogitTransform] = []
    if largest > 0:
        factor = 2.0 * softcap / largest
        head, forward = _probe_logits(model, hf_model, device, widen=factor)
        fits = _fit(hf_model, head, forward)  # the same s and cap, of the multiplied y
    if len(fits) != 1:
        raise LogitTransformError(
            f"{name}'s config names a soft cap of {softcap:g}, and its logits on the probe (at "
            f"most {largest:.3g}) fit both `{capped}` and `{plain}`; with the output layer's "
            "logits multiplied to twice the cap the forward's still fit both (or its logits "
            "are 0). The scored path cannot know which log-probs the sampler draws from: "
            "remove the soft cap from the config if the forward does not apply it"
        )
    return fits[0]


def _probe_logits(
    model: Any, hf_model: Any, device: torch.device, widen: float = 1.0
) -> tuple[torch.Tensor, ...]:
    """The output layer's logits and the forward's, ``[1, T, V]`` each, on a probe input;
    with ``widen``, the output layer's logits multiplied by it inside the forward (a hook on
    the output layer) and in what is returned.

    Raises:
        LogitTransformError: the decoder, or the widened output layer, did not run as a module.
    """
    output_layer = hf_model.get_output_embeddings()
    caught: list[torch.Tensor] = []
    widened: list[bool] = []

    def scale(_layer: Any, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        widened.append(True)
        return output * widen

    def head(_decoder: Any, _inputs: Any, output: Any) -> None:
        # inside the forward, where an FSDP root's weights are gathered
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        weight, bias = output_layer.weight, output_layer.bias
        if hidden.shape[-1] != weight.shape[-1]:
            raise LogitTransformError(
                f"{type(hf_model).__name__}: its decoder's last hidden state has width "
                f"{hidden.shape[-1]} and its output layer takes {weight.shape[-1]}: a module "
                "runs between them that the scored path does not apply"
            )
        caught.append(torch.nn.functional.linear(hidden, weight, bias) * widen)

    ids = _probe_ids(hf_model.config, int(output_layer.weight.shape[0]), device)
    handles = [hf_model.get_decoder().register_forward_hook(head)]
    if widen != 1.0:
        handles.append(output_layer.register_forward_hook(scale))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    if not caught:
        raise LogitTransformError(
            f"{type(hf_model).__name__}: its decoder (`get_decoder()`) did not run in the "
            "forward, so the scored path cannot catch the last hidden state"
        )
    if widen != 1.0 and not widened:
        raise LogitTransformError(
            f"{type(hf_model).__name__}'s config names a soft cap, and its logits on the probe "
            "are too small to tell whether its forward applies it; a second probe multiplies "
            "the output layer's logits, but the forward does not call the output layer "
            "(`get_output_embeddings()`) as a module. The scored path cannot know which "
            "log-probs the sampler draws from: remove the soft cap from the config if the "
            "forward does not apply it"
        )
    return caught[-1], logits.logits


def _probe_ids(config: Any, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Ordinary token ids spread over the vocabulary (no image or other special token)."""
    special = {
        value
        for cfg in (config, config.get_text_config())
        for name, value in vars(cfg).items()
        if name.endswith(("token_id", "token_index")) and isinstance(value, int)
    }
    spread = range(vocab_size // 5, vocab_size, max(1, vocab_size // (3 * _PROBE_TOKENS)))
    ids = [token for token in spread if token not in special][:_PROBE_TOKENS]
    return torch.tensor([ids], device=device)


def _fit(
    hf_model: Any, head_logits: torch.Tensor, forward_logits: torch.Tensor
) -> list[LogitTransform]:
    """The scale and soft cap that take the head's logits to the forward's: one transform,
    or, where the config has a soft cap, the capped and the plain one when both fit (the
    probe cannot tell which applies); an error when none does."""
    name = type(hf_model).__name__
    if forward_logits.shape != head_logits.shape:
        raise LogitTransformError(
            f"{name}'s forward returns logits of shape {tuple(forward_logits.shape)}, its output "
            f"layer {tuple(head_logits.shape)}: the forward drops or adds vocabulary entries after "
            "the head, which the scored path cannot reproduce"
        )
    y, z = head_logits.double().flatten(), forward_logits.double().flatten()
    values = _config_values(hf_model.config)
    softcap = next((values[field] for field in SOFTCAP_FIELDS if field in values), None)
    precision = _precision(head_logits, forward_logits)
    tolerance = precision * max(1.0, z.abs().max().item())
    fits: list[tuple[float, LogitTransform]] = []
    found: list[LogitTransform] = []
    # a config may carry a soft cap its forward does not apply: then the plain scale fits;
    # the scale snapped to a config value first, as fitted if that is too far
    for cap in dict.fromkeys((softcap, None)):
        fitted = _fitted_scale(y, z, cap)
        for scale in dict.fromkeys((_snap(fitted, values, precision), fitted)):
            transform = LogitTransform(scale=scale, softcap=cap)
            error = (transform.apply_(y.clone()) - z).abs().max().item()
            if error <= tolerance:
                found.append(transform)
                break
            fits.append((error, transform))
    if found:
        return found
    error, transform = min(fits, key=lambda fit: fit[0])
    raise LogitTransformError(
        f"{name}'s logits are not its output layer's logits of the decoder's last hidden state "
        f"under a transform the scored path can reproduce: the closest fit, {transform} (y the "
        f"output layer's logits, z the forward's), is off by up to {error:.3g} (tolerance "
        f"{tolerance:.3g}) on a {_PROBE_TOKENS}-token probe. The scored path applies the "
        "output layer a chunk at a time and would train on other log-probs than the "
        "sampler's. Supported: a scale, then a tanh soft cap read from the config's "
        f"{', '.join(f'`{field}`' for field in SOFTCAP_FIELDS)}; describe another transform "
        "in agile_llmenvs/training/objective/logit_transform.py"
    )


def _fitted_scale(y: torch.Tensor, z: torch.Tensor, softcap: float | None) -> float:
    """Least squares ``s`` in ``z = cap(s * y)``, on entries the soft cap leaves invertible."""
    if softcap is not None:
        keep = (z / softcap).abs() < 0.9
        y, z = y[keep], softcap * torch.atanh(z[keep] / softcap)
    norm = float(y @ y)
    return float(y @ z) / norm if norm > 0 else 1.0


def _snap(scale: float, values: dict[str, float], precision: float) -> float:
    """``scale`` replaced by 1, a config value or its inverse when one of them is that close."""
    candidates = [1.0, *values.values(), *(1.0 / value for value in values.values())]
    closest = min(candidates, key=lambda candidate: abs(candidate - scale))
    return closest if abs(closest - scale) <= max(1e-3, 4 * precision) * abs(closest) else scale


def _config_values(config: Any) -> dict[str, float]:
    """The config's non-trivial soft cap and scale fields (the text config's included)."""
    values: dict[str, float] = {}
    for cfg in (config.get_text_config(), config):
        for field in (*SOFTCAP_FIELDS, *SCALE_FIELDS):
            value = getattr(cfg, field, None)
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isfinite(value) and value > 0 and field not in values:
                values[field] = float(value)
    return values


def _precision(*tensors: torch.Tensor) -> float:
    """The relative tolerance of the lowest-precision dtype among ``tensors``."""
    eps = max(torch.finfo(tensor.dtype).eps for tensor in tensors)
    return max(1e-5, 4 * eps)
