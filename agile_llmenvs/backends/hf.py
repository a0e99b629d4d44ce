"""Generation with a ``transformers`` causal LM: one batched ``generate`` per call."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agile_llmenvs.backends.local import LocalChatBackend, cut_at_stop
from agile_llmenvs.backends.types import Generation, SamplingParams
from agile_llmenvs.core.images import SampleImages, image_model_inputs, prompt_images
from agile_llmenvs.errors import ManifestError

if TYPE_CHECKING:
    from agile_llmenvs.backends._hf_prefix import PrefixCache
    from agile_llmenvs.backends._hf_sampling import SampledLogprobs

__all__ = ["HFBackend", "HFConfig", "check_model_dir"]

logger = logging.getLogger(__name__)

# What the hub accepts as a repo id: `name` or `namespace/name`.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def check_model_dir(path: str | os.PathLike[str], *, field: str = "model_path") -> Path:
    """Check that ``path`` is a local model directory: one holding ``config.json`` (or the
    ``adapter_config.json`` of LoRA adapters).

    Nothing is downloaded at run time, so a hub id is never looked up: a path that does not
    exist locally is an error, which says so when it looks like a hub id.

    Args:
        path: The model directory.
        field: The setting that named it (``model.path``), named in the message.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ManifestError: ``path`` does not exist, is not a directory, or holds neither
            config; the message starts with ``field`` and says how to fix it.
    """
    model_dir = Path(path)
    shown = str(path)
    if not model_dir.exists():
        if _HUB_ID.match(shown):
            raise ManifestError(
                f"{field}: {shown!r} is not a local directory; if it is a Hugging Face hub id, "
                "download it first (nothing is downloaded at run time), e.g. `hf download "
                f"{shown} --local-dir models/{shown.rsplit('/', 1)[-1]}`, and set {field} to "
                "that directory"
            )
        raise ManifestError(
            f"{field}: {shown!r} does not exist; set it to a local model directory (the "
            "folder save_pretrained writes, holding config.json)"
        )
    if not model_dir.is_dir():
        raise ManifestError(
            f"{field}: {shown!r} is a file; set it to the model's directory (the folder "
            "save_pretrained writes, holding config.json)"
        )
    if not any((model_dir / name).is_file() for name in ("config.json", "adapter_config.json")):
        raise ManifestError(
            f"{field}: {shown!r} holds no config.json, so it is not a model directory; set it "
            "to the folder save_pretrained writes"
        )
    return model_dir


@dataclass(frozen=True)
class HFConfig:
    """How :class:`HFBackend` loads its model.

    Attributes:
        device: A torch device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        dtype: ``"auto"`` (the checkpoint's) or a torch dtype name (``"bfloat16"``).
        trust_remote_code: Passed to ``from_pretrained``.
        hub_kernels: Let transformers swap layers for kernels from the Hugging Face Hub
            (``use_kernels``; the ``kernels`` package downloads them on first use).
        prefix_cache: Keep each call's KV cache for the next, so that a multi-turn episode's
            next turn runs only its new ids through the model (see :class:`HFBackend`).
    """

    device: str = "cpu"
    dtype: str = "auto"
    trust_remote_code: bool = False
    hub_kernels: bool = False
    prefix_cache: bool = True


class HFBackend(LocalChatBackend):
    """A ``transformers`` model that generates a whole batch in one ``generate`` call.

    Prompts are left-padded with an attention mask, so every row continues right after its
    own prompt. Tokens are sampled from the distribution ``params`` describe, shaped in vLLM's
    order (:class:`~agile_llmenvs.backends.types.SamplingParams`), and the log-prob recorded
    for each sampled token is that distribution's, renormalised over the tokens top-k / top-p
    / min-p keep (or the whole vocabulary's, with ``truncated_logprobs=False``): what the
    trainer computes when it scores the sampled ids. Greedy decoding records temperature-1
    log-probs. Only one step's ``[B, V]`` log-probs are held at a time.

    Each call keeps its KV cache for the next (``prefix_cache``, on by default): a prompt
    that starts with a previous row's prompt and generation (a multi-turn episode's next
    turn) runs only its new ids through the model, and samples what a fresh call would
    (:mod:`~agile_llmenvs.backends._hf_prefix`). The cache is dropped when any weight changes
    in place, and :meth:`clear_prefix_cache` frees it at once.

    Only ``params`` shape the distribution: what the checkpoint's ``generation_config.json``
    would add (a repetition penalty, ``min_p``, suppressed tokens...) is not applied, and the
    first backend built on a model that sets any says so once in the log.

    Args:
        model_path: A local directory (or hub name, when the hub is reachable) of the model,
            or of LoRA adapters in peft's layout (a LoRA run's checkpoint ``model/``): they are
            loaded onto the base model their ``adapter_config.json`` names and merged in.
        config: How to load it; defaults to CPU and the checkpoint's dtype.

    Raises:
        ManifestError: ``model_path`` is not a local model directory (nothing is downloaded;
            see :func:`check_model_dir`).
    """

    def __init__(self, model_path: str | os.PathLike[str], *, config: HFConfig | None = None):
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

        from agile_llmenvs.tiny_vlm import is_vision_model

        check_model_dir(model_path)
        config = config or HFConfig()
        tokenizer = AutoTokenizer.from_pretrained(
            model_path, trust_remote_code=config.trust_remote_code
        )
        vision = is_vision_model(model_path)
        auto_class = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model: Any = _load_model(auto_class, model_path, config)
        self._init(model.to(config.device).eval(), tokenizer, prefix_cache=config.prefix_cache)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, *, prefix_cache: bool = True) -> HFBackend:
        """Wrap a model already in memory (a policy being trained, say).

        Args:
            model: The model (it may be wrapped by DDP, FSDP or ``accelerate``).
            tokenizer: Its tokenizer.
            prefix_cache: Keep each call's KV cache for the next (see :class:`HFBackend`).
        """
        backend = cls.__new__(cls)
        backend._init(model, tokenizer, prefix_cache=prefix_cache)
        return backend

    def _init(self, model: Any, tokenizer: Any, *, prefix_cache: bool = True) -> None:
        from agile_llmenvs.backends._hf_prefix import PrefixCache, supports_prefix_cache

        self.model = model
        self.supports_images = _is_vision_model(model)
        reusable = (
            prefix_cache and not self.supports_images and supports_prefix_cache(_unwrap(model))
        )
        self._prefix = PrefixCache(model) if reusable else None
        self._placeholder_ids = _placeholder_ids(model) if self.supports_images else ()
        self._tokenizer = tokenizer
        self._generation_config = _without_processors(model)
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
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        images: Sequence[SampleImages | None] | None = None,
    ) -> list[Generation]:
        """Sample one continuation per prompt, all rows in one ``model.generate`` call.

        Args:
            prompts: Token ids of each prompt (unpadded).
            params: Sampling parameters; ``seed`` makes sampling reproducible.
            images: The images each prompt shows (a vision-language model's); None: those
                of the prompts that are :class:`~agile_llmenvs.core.images.ImagePrompt`.

        Returns:
            One :class:`Generation` per prompt, in order.
        """
        import torch
        from transformers import LogitsProcessorList

        if not prompts:
            return []
        shown = prompt_images(prompts) if images is None else list(images)
        prefix = self._prefix_for(params, shown)
        rows = [list(p) for p in prompts] if prefix is not None else []
        planned = prefix.plan(rows, self._pad_id) if prefix is not None else None
        cache_kwargs: dict[str, Any] = {}
        if prefix is not None and planned is not None:
            input_ids, attention_mask = planned.input_ids, planned.attention_mask
            cache_kwargs[prefix.cache_argument] = planned.cache
        else:
            input_ids, attention_mask = self._left_pad(prompts)
        image_inputs = image_model_inputs(shown, input_ids, self.model)
        if image_inputs and not self.supports_images:
            raise ValueError(
                f"{type(self.model).__name__} is a text-only model but prompts show images: "
                "use a vision-language model, or an env that sends text only"
            )
        starts = (attention_mask.shape[1] - attention_mask.sum(dim=1)).tolist()
        sampler = _sampler(params, starts, self._placeholder_ids)
        with self._fork_rng(), self._no_grad(), self._plain_generation_config():
            if params.seed is not None:
                torch.manual_seed(params.seed)
            # Without return_dict_in_generate only the ids come back: no per-step logits, and
            # no KV cache kept alive past the call; with the prefix cache, the cache comes
            # back too and is kept for the next call.
            output = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                logits_processor=LogitsProcessorList([sampler]),
                return_dict_in_generate=prefix is not None,
                **cache_kwargs,
                **image_inputs,
                **self._generate_kwargs(params),
            )
            sequences = output.sequences if prefix is not None else output
            if prefix is not None:
                cache = getattr(output, "cache", None) or getattr(output, "past_key_values", None)
                prefix.keep(cache, sequences, attention_mask, rows, self._eos_ids)
            new_ids = sequences[:, input_ids.shape[1] :]
            logprobs = sampler.logprobs(sequences, input_ids.shape[1])
        return [
            self._finish(ids, lps, params)
            for ids, lps in zip(new_ids.tolist(), logprobs.tolist(), strict=True)
        ]

    def _prefix_for(self, params: SamplingParams, images: Sequence[Any]) -> PrefixCache | None:
        """The prefix cache, where this call may use and keep it: text only, no repetition
        penalty (it counts a row's context, holes included), not an FSDP-sharded model (its
        gathered weights are not the kept cache's to rely on). Otherwise the kept cache is
        dropped."""
        from agile_llmenvs.backends.types import TokenDistribution

        prefix = self._prefix
        if prefix is None:
            return None
        if any(images) or TokenDistribution.of(params).penalizes or not self._inference_mode():
            prefix.clear()
            return None
        return prefix

    def clear_prefix_cache(self) -> None:
        """Drop the KV cache kept from the last call, freeing its memory (the next call
        prefills its prompts whole). A change of weights drops it too, at the next call."""
        if self._prefix is not None:
            self._prefix.clear()

    def _fork_rng(self) -> Any:
        """Restores the generators a seeded call reseeds: the CPU's and the model's GPU's."""
        import torch

        device = self.model.device
        devices = [device] if device.type == "cuda" else []
        return torch.random.fork_rng(devices=devices, device_type=device.type)

    def _no_grad(self) -> Any:
        """``inference_mode``, or plain ``no_grad`` for an FSDP-sharded model: the weights it
        gathers for a forward are kept for training, which cannot update inference tensors."""
        import torch

        return torch.inference_mode() if self._inference_mode() else torch.no_grad()

    def _inference_mode(self) -> bool:
        """Whether the model is not FSDP-sharded (see :meth:`_no_grad`)."""
        from torch.distributed.fsdp import FSDPModule

        # a LoRA (peft) policy is sharded under its wrapper
        model = self.model
        if hasattr(model, "disable_adapter"):
            model = model.get_base_model()
        return not isinstance(model, FSDPModule)

    def _left_pad(self, prompts: Sequence[Sequence[int]]) -> tuple[Any, Any]:
        import torch

        lengths = [len(p) for p in prompts]
        width = max(lengths)
        if min(lengths) == 0:
            raise ValueError("every prompt needs at least one token")
        pad = self._pad_id  # one tensor from one padded list: no tensor per row
        ids = torch.tensor(
            [[pad] * (width - n) + list(p) for p, n in zip(prompts, lengths, strict=True)]
        )
        mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
        device = self.model.device
        return ids.to(device), mask.to(device)

    def _generate_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        """``generate``'s settings beyond the prompts: the length and the stops. It decodes
        greedily: the sampler shapes the distribution and draws each token itself."""
        kwargs: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "pad_token_id": self._pad_id,
            "eos_token_id": sorted(self._eos_ids),
            "do_sample": False,
            "top_k": None,
        }
        if params.stop:
            kwargs.update(stop_strings=list(params.stop), tokenizer=self._tokenizer)
        return kwargs

    @contextlib.contextmanager
    def _plain_generation_config(self) -> Iterator[None]:
        """The model's ``generation_config`` without its processors while ``generate`` runs
        (``generate`` fills every unset value from the model's own)."""
        model = _unwrap(self.model)
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        own = model.generation_config
        model.generation_config = self._generation_config
        try:
            yield
        finally:
            model.generation_config = own

    def _finish(self, ids: list[int], logprobs: list[float], params: SamplingParams) -> Generation:
        n, text, stopped = cut_at_stop(ids, self._tokenizer, self._eos_ids, params.stop)
        return Generation(
            token_ids=tuple(ids[:n]),
            logprobs=tuple(logprobs[:n]),
            text=text,
            finish_reason="stop" if stopped else "length",
        )


def _load_model(auto_class: Any, model_path: str | os.PathLike[str], config: HFConfig) -> Any:
    """The model at ``model_path``; a folder of LoRA adapters is merged into its base model."""
    kwargs = {
        "dtype": config.dtype,
        "trust_remote_code": config.trust_remote_code,
        "use_kernels": config.hub_kernels,
    }
    adapters = os.path.join(model_path, "adapter_config.json")
    if not os.path.isfile(adapters):
        return auto_class.from_pretrained(model_path, **kwargs)
    try:
        from peft import PeftConfig, PeftModel
    except ImportError as exc:
        from agile_llmenvs.errors import OptionalDependencyError

        raise OptionalDependencyError(
            "peft", extra="train", feature=f"loading the LoRA adapters in {model_path}"
        ) from exc
    base_path = PeftConfig.from_pretrained(os.fspath(model_path)).base_model_name_or_path
    base = auto_class.from_pretrained(base_path, **kwargs)
    with warnings.catch_warnings():  # peft asks transformers 5 a question it has renamed
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        return PeftModel.from_pretrained(base, model_path).merge_and_unload()


def _is_vision_model(model: Any) -> bool:
    """Whether ``model`` takes images (a vision-language model's config has a vision part)."""
    model = _unwrap(model)
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def _sampler(
    params: SamplingParams, prompt_starts: list[int], forbidden: tuple[int, ...] = ()
) -> SampledLogprobs:
    """The logits processor that samples as ``params`` ask (never a ``forbidden`` id) and
    records the log-probs."""
    from agile_llmenvs.backends._hf_sampling import SampledLogprobs
    from agile_llmenvs.backends.types import TokenDistribution

    return SampledLogprobs(
        TokenDistribution.of(params),
        prompt_starts=prompt_starts,
        forbidden=forbidden,
        sample=not params.greedy,
    )


#: ``generation_config`` fields that add a logits processor to ``generate`` (transformers'
#: ``_get_logits_processor``); their unset value (None) adds none.
PROCESSOR_FIELDS = (
    "bad_words_ids",
    "begin_suppress_tokens",
    "encoder_no_repeat_ngram_size",
    "encoder_repetition_penalty",
    "epsilon_cutoff",
    "eta_cutoff",
    "exponential_decay_length_penalty",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "guidance_scale",
    "min_length",
    "min_new_tokens",
    "min_p",
    "no_repeat_ngram_size",
    "remove_invalid_values",
    "renormalize_logits",
    "repetition_penalty",
    "sequence_bias",
    "suppress_tokens",
    "temperature",
    "top_h",
    "top_k",
    "top_p",
    "typical_p",
    "watermarking_config",
)
#: Values of those fields that add no processor either.
_NEUTRAL = {
    "encoder_repetition_penalty": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "guidance_scale": 1.0,
    "min_length": 0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "remove_invalid_values": False,
    "renormalize_logits": False,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "typical_p": 1.0,
}
_LOGGED_ATTRIBUTE = "_agile_llmenvs_generation_config_logged"


def _without_processors(model: Any) -> Any:
    """``model``'s ``generation_config`` without a field that adds a logits processor, so that
    only the sampler shapes what ``generate`` samples; the first call for a model whose config
    sets such fields logs which, once."""
    config = copy.deepcopy(model.generation_config)
    ignored = {}
    for name in PROCESSOR_FIELDS:
        value = getattr(config, name, None)
        if value is not None and value != _NEUTRAL.get(name):
            ignored[name] = value
        if hasattr(config, name):
            setattr(config, name, None)
    holder = _unwrap(model)
    if ignored and not holder.__dict__.get(_LOGGED_ATTRIBUTE):
        holder.__dict__[_LOGGED_ATTRIBUTE] = True
        settings = ", ".join(f"{name}={value!r}" for name, value in sorted(ignored.items()))
        logger.warning(
            "%s's generation_config sets %s: not applied. Sampling is what the manifest says "
            "(training.temperature, top_p, top_k, min_p, repetition_penalty), and the trainer "
            "scores exactly that; copy a setting there to sample with it.",
            type(holder).__name__,
            settings,
        )
    return config


def _unwrap(model: Any) -> Any:
    """The model inside DDP / FSDP / ``accelerate`` wrappers (``.module``)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _placeholder_ids(model: Any) -> tuple[int, ...]:
    """A vision-language model's image and video placeholder ids: only the processor puts
    them in a sequence, each standing for an image's features."""
    config = getattr(_unwrap(model), "config", None)
    names = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
    ids = {getattr(config, name, None) for name in names}
    return tuple(sorted(int(i) for i in ids if i is not None))
