"""Generation with a ``transformers`` causal LM: one batched ``generate`` per call."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agile_llmenvs.backends.local import LocalChatBackend, cut_at_stop
from agile_llmenvs.backends.types import Generation, SamplingParams

__all__ = ["HFBackend", "HFConfig"]


@dataclass(frozen=True)
class HFConfig:
    """How :class:`HFBackend` loads its model.

    Attributes:
        device: A torch device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        dtype: ``"auto"`` (the checkpoint's) or a torch dtype name (``"bfloat16"``).
        trust_remote_code: Passed to ``from_pretrained``.
    """

    device: str = "cpu"
    dtype: str = "auto"
    trust_remote_code: bool = False


class HFBackend(LocalChatBackend):
    """A ``transformers`` model that generates a whole batch in one ``generate`` call.

    Prompts are left-padded with an attention mask, so every row continues right after its
    own prompt. Log-probs are those of the model's own distribution (temperature 1, before
    top-p/top-k), as vLLM reports them, which is what policy-gradient losses need.

    Args:
        model_path: A local directory (or hub name, when the hub is reachable) of the model.
        config: How to load it; defaults to CPU and the checkpoint's dtype.
    """

    def __init__(self, model_path: str | os.PathLike[str], *, config: HFConfig | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        config = config or HFConfig()
        tokenizer = AutoTokenizer.from_pretrained(
            model_path, trust_remote_code=config.trust_remote_code
        )
        model: Any = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=config.dtype, trust_remote_code=config.trust_remote_code
        )
        self._init(model.to(config.device).eval(), tokenizer)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any) -> HFBackend:
        """Wrap a model already in memory (a policy being trained, say)."""
        backend = cls.__new__(cls)
        backend._init(model, tokenizer)
        return backend

    def _init(self, model: Any, tokenizer: Any) -> None:
        self.model = model
        self._tokenizer = tokenizer
        eos = model.generation_config.eos_token_id
        eos = eos if eos is not None else tokenizer.eos_token_id
        self._eos_ids = frozenset(eos if isinstance(eos, list) else [eos])
        pad = tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else min(self._eos_ids))

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer."""
        return self._tokenizer

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation]:
        """Sample one continuation per prompt, all rows in one ``model.generate`` call.

        Args:
            prompts: Token ids of each prompt (unpadded).
            params: Sampling parameters; ``seed`` makes sampling reproducible.

        Returns:
            One :class:`Generation` per prompt, in order.
        """
        import torch

        if not prompts:
            return []
        input_ids, attention_mask = self._left_pad(prompts)
        with torch.random.fork_rng(devices=[]), torch.inference_mode():
            if params.seed is not None:
                torch.manual_seed(params.seed)
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                **self._generate_kwargs(params),
            )
            new_ids = out.sequences[:, input_ids.shape[1] :]
            logprobs = torch.stack(
                [
                    torch.log_softmax(step.float(), dim=-1).gather(-1, new_ids[:, t, None])[:, 0]
                    for t, step in enumerate(out.logits)
                ],
                dim=1,
            )
        return [
            self._finish(ids, lps, params)
            for ids, lps in zip(new_ids.tolist(), logprobs.tolist(), strict=True)
        ]

    def _left_pad(self, prompts: Sequence[Sequence[int]]) -> tuple[Any, Any]:
        import torch

        width = max(len(p) for p in prompts)
        if min(len(p) for p in prompts) == 0:
            raise ValueError("every prompt needs at least one token")
        ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        device = self.model.device
        return ids.to(device), mask.to(device)

    def _generate_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "return_dict_in_generate": True,
            "output_logits": True,
            "pad_token_id": self._pad_id,
            "eos_token_id": sorted(self._eos_ids),
        }
        if params.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(
                do_sample=True,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k or 0,
            )
        if params.stop:
            kwargs.update(stop_strings=list(params.stop), tokenizer=self._tokenizer)
        return kwargs

    def _finish(self, ids: list[int], logprobs: list[float], params: SamplingParams) -> Generation:
        n, text, stopped = cut_at_stop(ids, self._tokenizer, self._eos_ids, params.stop)
        return Generation(
            token_ids=tuple(ids[:n]),
            logprobs=tuple(logprobs[:n]),
            text=text,
            finish_reason="stop" if stopped else "length",
        )
