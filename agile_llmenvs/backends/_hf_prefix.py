"""The HF backend's prefix cache: a multi-turn episode's next call reuses the keys and values
its previous call computed.

A multi-turn rollout asks the backend for turn ``t + 1`` with the ids of turn ``t``'s context,
its sampled ids and the next observation: everything but the observation was already run
through the model by the previous call. :class:`PrefixCache` keeps that call's KV cache with,
for each row, the real tokens it holds (the row's prompt and the tokens generated after it,
not the padding), and plans the next call from it:

* each new prompt is matched to a kept row whose tokens it starts with (the row's whole
  tokens when one does; else the longest common prefix with a row that shares its prompt,
  as when a stop string cut the generation short);
* the kept rows are selected in the new order (a row may serve several prompts, as the
  continuations branched from one state), and their columns past the shared prefix are
  masked out;
* each prompt's remaining ids are placed right-aligned after the cached columns, with
  masked padding before them; ``generate`` runs only those columns through the model.

Positions come from the attention mask (``generate`` numbers each row's unmasked columns
``0, 1, ...``), so a row's tokens sit at the positions a fresh call gives them and the
model attends to the same tokens: the logits are the same up to floating-point rounding.

The cache is dropped, and the call prefilled whole, when any weight changed since it was
kept (any parameter's in-place version counter moved: an optimizer step, a weight load), when
a prompt matches no row, or when the holes would make the call much wider than its prompts.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from functools import cached_property
from typing import Any

__all__ = ["CachedCall", "PrefixCache", "supports_prefix_cache"]

#: A call reuses the cache only while its width stays within this factor of its longest
#: prompt (plus :data:`_SLACK` columns): the holes left by shorter rows are not free.
_WIDTH_FACTOR = 1.5
_SLACK = 64


def supports_prefix_cache(model: Any) -> bool:
    """Whether the kept cache can be reused for ``model``: a decoder whose layers all attend
    to every earlier column (no sliding window, which counts columns, holes included, and no
    recurrent state), with a ``DynamicCache``."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return all(kind == "full_attention" for kind in layer_types)
    window = getattr(config, "sliding_window", None)
    return not window or getattr(config, "use_sliding_window", True) is False


def _plain_dynamic(cache: Any) -> bool:
    """Whether ``cache`` is a ``DynamicCache`` of full-attention layers only (what a row
    selection and a masked column keep exact)."""
    layers = getattr(cache, "layers", None) or []
    return (
        type(cache).__name__ == "DynamicCache"
        and len(layers) > 0
        and all(type(layer).__name__ == "DynamicLayer" for layer in layers)
    )


@dataclass
class _Kept:
    """The previous call's cache and what it was given and returned; what each row holds is
    worked out when a next call asks (a single-turn call pays nothing for it)."""

    cache: Any  # [B, W] keys and values
    ids: Any  # [B, W] the ids at the cached columns (padding included)
    attention_mask: Any  # [B, W0] the call's mask over its input columns
    prompts: list[list[int]]
    eos_ids: frozenset[int]
    version: int

    @cached_property
    def rows(self) -> tuple[list[list[int]], list[list[int]]]:
        """Each row's tokens, in order (its prompt, then what it generated up to its end),
        and the column of each of them."""
        width = self.attention_mask.shape[1]
        generated = self.ids[:, width:].tolist()
        tokens, columns = [], []
        for prompt, new, row_mask in zip(
            self.prompts, generated, self.attention_mask.tolist(), strict=True
        ):
            ended = next((i + 1 for i, t in enumerate(new) if t in self.eos_ids), len(new))
            tokens.append([*prompt, *new[:ended]])
            own = [column for column, real in enumerate(row_mask) if real]
            columns.append(own + list(range(width, width + ended)))
        return tokens, columns

    @property
    def tokens(self) -> list[list[int]]:
        return self.rows[0]

    @property
    def columns(self) -> list[list[int]]:
        return self.rows[1]


@dataclass(frozen=True)
class CachedCall:
    """A planned call: ``input_ids`` and ``attention_mask`` ``[B, W + K]`` and the cache
    (``[B, W]``, its rows selected for this call) to pass to ``generate``."""

    input_ids: Any
    attention_mask: Any
    cache: Any


class PrefixCache:
    """What a call to the HF backend keeps for the next (see the module docstring).

    Args:
        model: The model generating (its parameters' versions tell when weights changed).
    """

    def __init__(self, model: Any) -> None:
        self._model = model
        self._kept: _Kept | None = None
        self._lock = threading.Lock()  # a cache serves one call: two at once take one each
        self._cursor = 0
        self.reused = 0  # prompt tokens the last call did not run through the model again
        forward = getattr(type(model), "forward", None)
        names = inspect.signature(forward).parameters if forward is not None else {}
        self.cache_argument = "cache" if "cache" in names else "past_key_values"

    def clear(self) -> None:
        """Drop the kept cache (its memory is freed)."""
        self._kept = None

    def _version(self) -> int:
        return sum(p._version for p in self._model.parameters())

    def plan(self, prompts: list[list[int]], pad_id: int) -> CachedCall | None:
        """The call that reuses the kept cache for ``prompts``, or None (prefill them whole):
        nothing kept, weights changed, a prompt matched no row, or too many holes."""
        import torch

        with self._lock:  # the cache is the call's now (generate extends it in place)
            kept, self._kept = self._kept, None
        self.reused = 0
        if kept is None or self._version() != kept.version:
            return None
        picks: list[tuple[int, int]] = []  # (kept row, tokens shared)
        for prompt in prompts:
            match = self._match(kept, prompt)
            if match is None:
                return None
            picks.append(match)
        cached_width = kept.ids.shape[1]
        suffix = max(len(p) - shared for p, (_, shared) in zip(prompts, picks, strict=True))
        if cached_width + suffix > _WIDTH_FACTOR * max(map(len, prompts)) + _SLACK:
            return None
        rows = torch.tensor([row for row, _ in picks], device=kept.ids.device)
        ids = torch.full((len(prompts), cached_width + suffix), pad_id, dtype=kept.ids.dtype)
        mask = torch.zeros_like(ids)
        ids[:, :cached_width] = kept.ids[rows].cpu()
        for index, (prompt, (row, shared)) in enumerate(zip(prompts, picks, strict=True)):
            mask[index, kept.columns[row][:shared]] = 1
            rest = prompt[shared:]
            ids[index, ids.shape[1] - len(rest) :] = torch.tensor(rest, dtype=ids.dtype)
            mask[index, ids.shape[1] - len(rest) :] = 1
        cache = kept.cache
        cache.batch_select_indices(rows)
        device = self._model.device
        self.reused = sum(shared for _, shared in picks)
        return CachedCall(ids.to(device), mask.to(device), cache)

    def _match(self, kept: _Kept, prompt: list[int]) -> tuple[int, int] | None:
        """The kept row to reuse for ``prompt`` and how many of its tokens it shares (at
        least one id of the prompt is left to run: its logits start the generation)."""
        count = len(kept.tokens)
        order = [(self._cursor + step) % count for step in range(count)]
        for row in order:  # a row whose every token the prompt starts with
            tokens = kept.tokens[row]
            if len(tokens) < len(prompt) and prompt[: len(tokens)] == tokens:
                self._cursor = row + 1
                return row, len(tokens)
        for row in order:  # else a row with the same prompt (its generation was cut short)
            length = len(kept.prompts[row])
            tokens = kept.tokens[row]
            if length < len(prompt) and prompt[:length] == tokens[:length]:
                self._cursor = row + 1
                return row, _common_prefix(tokens, prompt, length, len(prompt) - 1)
        return None

    def keep(
        self,
        cache: Any,
        sequences: Any,
        attention_mask: Any,
        prompts: list[list[int]],
        eos_ids: frozenset[int],
    ) -> None:
        """Keep a finished call's cache for the next call.

        Args:
            cache: The cache ``generate`` returned: the prompt's columns and every generated
                column but the last (never run through the model).
            sequences: ``[B, W + T]`` what ``generate`` returned.
            attention_mask: ``[B, W]`` the call's mask over its input columns.
            prompts: The call's prompts.
            eos_ids: Ids that end a row's generation (its later columns are padding).
        """
        if not _plain_dynamic(cache):
            self.clear()
            return
        cached = cache.get_seq_length()
        kept = _Kept(
            cache, sequences[:, :cached], attention_mask, prompts, eos_ids, self._version()
        )
        with self._lock:
            self._kept, self._cursor = kept, 0


def _common_prefix(a: list[int], b: list[int], low: int, high: int) -> int:
    """The length of the longest common prefix of ``a`` and ``b``, known to be at least
    ``low`` and capped at ``high`` (a bisection over slice comparisons)."""
    high = min(high, len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
