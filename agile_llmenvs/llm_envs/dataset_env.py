"""DatasetEnv: teacher-forced SFT and preference (DPO) batches over dataset rows.

Nothing is generated. Every row is tokenized once, up front: the prompt through the
tokenizer's chat template with the generation prompt, each response without special tokens
and closed by the eos token (the end of the assistant turn). A sequence is exactly prompt ids +
response ids; nothing is decoded and re-encoded.

A row may show images (:mod:`~agile_llmenvs.llm_envs.dataset_images`: its ``images`` column)
to a vision-language policy: its prompt is then the processor's own ids, each image expanded
into its placeholder tokens (which count toward ``max_context_length``), and its batch row
carries the images' pixel tensors, made from the kept images when the batch is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from agile_llmenvs.llm_envs.dataset_images import (
    IMAGES_COLUMN,
    decode_cell,
    show_images,
)
from agile_llmenvs.llm_envs.framing import ChatFramer, ChatTemplateError, apply_chat_template
from agile_llmenvs.llm_envs.image_framing import ImageFramer
from agile_llmenvs.llm_envs.rows import DatasetError, require_columns
from agile_llmenvs.llm_envs.tasks import TaskAssigner
from agile_llmenvs.transport.images import ImageObservationError, image_count, image_values

if TYPE_CHECKING:
    import torch
    from datasets import Dataset

    from agile_llmenvs.core.images import SampleImages

__all__ = ["IGNORE_INDEX", "DatasetEnv", "PreferenceBatch", "SFTBatch"]

logger = logging.getLogger(__name__)

#: The label of a position the loss skips: prompt and padding.
IGNORE_INDEX = -100

Objective = Literal["preference", "sft"]
_BatchT = TypeVar("_BatchT", "SFTBatch", "PreferenceBatch")


@dataclass(frozen=True)
class SFTBatch:
    """One SFT batch, right-padded. Tensors are ``[B, T]`` LongTensors, ``prompt_lengths`` ``[B]``.

    Attributes:
        input_ids: Prompt ids + response ids, then the tokenizer's pad id.
        attention_mask: 1 on the row's tokens, 0 on padding.
        labels: ``input_ids`` with ``IGNORE_INDEX`` (-100) on the prompt and the padding.
        prompt_lengths: Prompt tokens of each row.
        images_B: The images each row shows, with their pixel tensors (None for a row that
            shows none); empty when no row shows any. They stay on the CPU in :meth:`to`:
            :func:`~agile_llmenvs.core.images.image_model_inputs` moves a micro-batch's.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    prompt_lengths: torch.Tensor
    images_B: tuple[SampleImages | None, ...] = ()

    def to(self, device: torch.device | str) -> SFTBatch:
        """The same batch on ``device``."""
        return _to(self, device)


@dataclass(frozen=True)
class PreferenceBatch:
    """One preference (DPO) batch: row ``i`` of chosen and of rejected share prompt ``i``.

    Chosen and rejected are right-padded to one common width ``T``, so they can be stacked
    into a single forward pass.

    Attributes:
        chosen_input_ids: Prompt ids + chosen response ids, then pad ids. ``[B, T]``.
        chosen_attention_mask: 1 on the row's tokens, 0 on padding.
        rejected_input_ids: Prompt ids + rejected response ids, then pad ids. ``[B, T]``.
        rejected_attention_mask: 1 on the row's tokens, 0 on padding.
        prompt_lengths: Prompt tokens of each row. ``[B]``.
        chosen_labels: ``chosen_input_ids`` with -100 on the prompt and the padding.
        rejected_labels: ``rejected_input_ids`` with -100 on the prompt and the padding.
    """

    chosen_input_ids: torch.Tensor
    chosen_attention_mask: torch.Tensor
    rejected_input_ids: torch.Tensor
    rejected_attention_mask: torch.Tensor
    prompt_lengths: torch.Tensor
    chosen_labels: torch.Tensor
    rejected_labels: torch.Tensor

    def to(self, device: torch.device | str) -> PreferenceBatch:
        """The same batch on ``device``."""
        return _to(self, device)


def _to(batch: _BatchT, device: torch.device | str) -> _BatchT:
    tensors = (f.name for f in fields(batch) if f.name != "images_B")
    return replace(batch, **{name: getattr(batch, name).to(device) for name in tensors})


@dataclass(frozen=True)
class _Example:
    """A tokenized row: its full sequences (one for sft; chosen then rejected), the length
    of the prompt they share, and for a row that shows images, its prompt messages with them
    (the batch's pixel tensors are made from these, so the dataset's are never all held)."""

    prompt_length: int
    sequences: tuple[list[int], ...]
    shown: tuple[Mapping[str, Any], ...] | None = None


@dataclass(frozen=True)
class _Budget:
    """Truncation and filtering of a completion after its prompt."""

    max_context_length: int | None
    min_completion_length: int

    def fit(self, prompt_length: int, completion: list[int]) -> list[int] | None:
        """The completion cut to the context budget; None when too little of it is left."""
        if self.max_context_length is not None:
            completion = completion[: max(self.max_context_length - prompt_length, 0)]
        return completion if len(completion) >= self.min_completion_length else None


class DatasetEnv:
    """Dataset-backed LLM env for SFT and DPO (no generation): typed, padded batches of rows.

    Rows have a ``prompt`` (a string, shown as one user message, or a list of chat messages)
    and, for ``sft``, the ``response_column``; for ``preference``, ``chosen`` and ``rejected``.
    An ``sft`` row may also show images, its ``images`` column (a list of image values, see
    :mod:`~agile_llmenvs.llm_envs.dataset_images`), to a vision-language policy (given as its
    ``vision_processor``); the processor's chat template then frames every row.
    With ``max_context_length`` the prompt is kept whole and each response is cut to fit; a row
    is dropped when less than ``min_completion_length`` tokens (at least one, counting the
    closing eos) of a response are left, so a prompt alone over the budget drops its row.

    Training batches follow :class:`TaskAssigner`: each epoch reshuffles the train rows (the
    same permutation on every rank, from ``seed`` and the epoch) and deals them into
    ``world_size`` disjoint shards of ``ceil(N / world_size)`` rows; a short shard repeats its
    own first rows, so ranks stay in lock-step. Batches run across epoch boundaries.

    :meth:`eval_mode` switches :meth:`next_batch` to the whole test split, in order, once
    (every rank sees all of it; the last batch may be short), after which it raises
    ``StopIteration``; :meth:`train_mode` switches back, where training left off.

    Args:
        train_dataset: The train rows.
        test_dataset: The test rows (may be empty).
        tokenizer: A Hugging Face tokenizer with a chat template and an eos token.
        objective: ``sft`` (:class:`SFTBatch`) or ``preference`` (:class:`PreferenceBatch`).
        response_column: The response column of ``sft`` rows.
        chat_template_kwargs: Extra keyword arguments for ``apply_chat_template`` (a
            ``chat_template`` entry replaces the tokenizer's template).
        data_batch_size_per_gpu: Rows per batch on each rank.
        max_context_length: Token budget of prompt + response (None: no limit).
        min_completion_length: Fewest response tokens a row must keep (None: 1).
        seed: Seed of the per-epoch shuffles.
        rank: This process's shard index in ``[0, world_size)``.
        world_size: Number of data-parallel ranks.
        vision_processor: A vision-language policy's processor (``AutoProcessor``); None: the
            policy is text-only.
        image_root: The folder an image given as a file path is relative to (None: a
            string image value is base64 only).

    Raises:
        DatasetError: A required column is missing, a value has the wrong type, a
            preference row shows images (not supported yet), or fewer train rows than ranks
            are left after filtering.
        ImageObservationError: A row shows images to a text-only policy, or one of its
            images does not decode.
    """

    def __init__(
        self,
        train_dataset: Dataset,
        test_dataset: Dataset,
        tokenizer: Any,
        *,
        objective: Objective,
        response_column: str = "response",
        chat_template_kwargs: Mapping[str, Any] | None = None,
        data_batch_size_per_gpu: int = 8,
        max_context_length: int | None = None,
        min_completion_length: int | None = None,
        seed: int = 42,
        rank: int = 0,
        world_size: int = 1,
        vision_processor: Any = None,
        image_root: str | os.PathLike[str] | None = None,
    ) -> None:
        if objective not in ("sft", "preference"):
            raise ValueError(f"objective must be 'sft' or 'preference', got {objective!r}")
        if data_batch_size_per_gpu < 1:
            raise ValueError(f"data_batch_size_per_gpu must be >= 1, got {data_batch_size_per_gpu}")
        self.objective: Objective = objective
        self.tokenizer = tokenizer
        self.data_batch_size_per_gpu = data_batch_size_per_gpu
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.pad_token_id = _pad_id(tokenizer)
        tokenize = _RowTokenizer(
            tokenizer,
            ("prompt", response_column) if objective == "sft" else ("prompt", "chosen", "rejected"),
            dict(chat_template_kwargs or {}),
            _Budget(max_context_length, max(1, min_completion_length or 1)),
            vision_processor=vision_processor,
            image_root=None if image_root is None else Path(image_root),
            allow_images=objective == "sft",
        )
        self._images = tokenize.images
        self._train = tokenize(train_dataset, "train")
        self._test = tokenize(test_dataset, "test")
        if len(self._train) < world_size:
            raise DatasetError(
                f"{len(self._train)} of {len(train_dataset)} train rows are left after "
                f"truncation and filtering; {world_size} rank(s) need at least one each "
                "(raise max_context_length or lower min_completion_length)"
            )
        self._assigner = TaskAssigner(len(self._train), seed=seed, rank=rank, world_size=world_size)
        self._mode: Literal["train", "eval"] = "train"
        self._test_position = 0

    @property
    def dataset_size(self) -> dict[str, int]:
        """``{"train": N, "test": M}`` row counts after filtering."""
        return {"train": len(self._train), "test": len(self._test)}

    @property
    def num_epochs(self) -> int:
        """Full passes completed over this rank's train shard."""
        return self._assigner.num_epochs

    @property
    def mode(self) -> Literal["train", "eval"]:
        """Which split :meth:`next_batch` serves."""
        return self._mode

    def next_batch(self) -> SFTBatch | PreferenceBatch:
        """The next ``data_batch_size_per_gpu`` rows as a typed batch.

        Raises:
            StopIteration: In eval mode, once the test split has been served.
        """
        if self._mode == "eval":
            start = self._test_position
            if start >= len(self._test):
                raise StopIteration
            examples = self._test[start : start + self.data_batch_size_per_gpu]
            self._test_position += len(examples)
            return self._collate(examples)
        return self._collate(
            [self._train[self._next_row()] for _ in range(self.data_batch_size_per_gpu)]
        )

    def iter_test(self) -> Iterator[SFTBatch | PreferenceBatch]:
        """The test split in order as batches, whatever the mode; it moves no cursor."""
        size = self.data_batch_size_per_gpu
        for start in range(0, len(self._test), size):
            yield self._collate(self._test[start : start + size])

    def eval_mode(self) -> None:
        """Serve the test split from its start, in order, once."""
        self._mode, self._test_position = "eval", 0

    def train_mode(self) -> None:
        """Serve training batches again, where they left off."""
        self._mode = "train"

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the exact batch sequence."""
        return {
            "train_rows": len(self._train),
            "world_size": self.world_size,
            "assigner": self._assigner.state_dict(),
            "mode": self._mode,
            "test_position": self._test_position,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` of an env over the same rows and ranks.

        Raises:
            DatasetError: The state was saved for another row count or world size.
        """
        saved = (int(state["train_rows"]), int(state["world_size"]))
        if saved != (len(self._train), self.world_size):
            raise DatasetError(
                f"the state was saved for {saved[0]} train rows over {saved[1]} rank(s); this "
                f"env has {len(self._train)} over {self.world_size}: resume with the same data, "
                "max_context_length, min_completion_length and world size"
            )
        self._assigner.load_state_dict(state["assigner"])
        self._mode, self._test_position = state["mode"], int(state["test_position"])

    def _next_row(self) -> int:
        row = self._assigner.next_task().row_index
        assert row is not None  # the assigner serves rows when it has a dataset
        return row

    def _collate(self, examples: Sequence[_Example]) -> SFTBatch | PreferenceBatch:
        import torch

        prompt_lengths = torch.tensor([e.prompt_length for e in examples], dtype=torch.long)
        width = max(len(s) for e in examples for s in e.sequences)
        if self.objective == "sft":
            ids, mask, labels = self._pad(examples, 0, width)
            return SFTBatch(ids, mask, labels, prompt_lengths, self._images_B(examples))
        chosen, rejected = self._pad(examples, 0, width), self._pad(examples, 1, width)
        return PreferenceBatch(
            chosen_input_ids=chosen[0],
            chosen_attention_mask=chosen[1],
            rejected_input_ids=rejected[0],
            rejected_attention_mask=rejected[1],
            prompt_lengths=prompt_lengths,
            chosen_labels=chosen[2],
            rejected_labels=rejected[2],
        )

    def _images_B(self, examples: Sequence[_Example]) -> tuple[SampleImages | None, ...]:
        """Each example's images with their tensors, the processor's for its prompt."""
        if self._images is None or all(e.shown is None for e in examples):
            return ()
        framer = self._images
        return tuple(None if e.shown is None else framer.prompt(e.shown)[1] for e in examples)

    def _pad(
        self, examples: Sequence[_Example], which: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded ids, attention mask and labels of each example's ``which`` sequence."""
        import torch

        ids_BT = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        mask_BT = torch.zeros_like(ids_BT)
        labels_BT = torch.full_like(ids_BT, IGNORE_INDEX)
        for row, example in enumerate(examples):
            sequence = example.sequences[which]
            end, start = len(sequence), example.prompt_length
            ids_BT[row, :end] = torch.tensor(sequence, dtype=torch.long)
            mask_BT[row, :end] = 1
            labels_BT[row, start:end] = ids_BT[row, start:end]
        return ids_BT, mask_BT, labels_BT


class _RowTokenizer:
    """Tokenizes rows into :class:`_Example` s, dropping those the budget cannot fit."""

    def __init__(
        self,
        tokenizer: Any,
        columns: tuple[str, ...],
        chat_template_kwargs: dict[str, Any],
        budget: _Budget,
        *,
        vision_processor: Any = None,
        image_root: Path | None = None,
        allow_images: bool = True,
    ) -> None:
        template = getattr(vision_processor, "chat_template", None)
        if template:  # a vision-language policy's prompts are its processor's
            chat_template_kwargs.setdefault("chat_template", template)
        if not getattr(tokenizer, "chat_template", None) and "chat_template" not in (
            chat_template_kwargs
        ):
            raise ChatTemplateError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                "give it one (the spec's chat_template_path)"
            )
        self.tokenizer, self.columns, self.budget = tokenizer, columns, budget
        self.kwargs = chat_template_kwargs
        self.framer = ChatFramer(tokenizer, chat_template_kwargs=chat_template_kwargs)
        self.end_of_turn = list(self.framer.end_of_turn_ids())
        if not self.end_of_turn:
            raise DatasetError(
                "the chat template closes an assistant turn with no special token and the "
                "tokenizer has no eos token to close each response; set tokenizer.eos_token"
            )
        self.images = (
            ImageFramer(vision_processor, self.framer) if vision_processor is not None else None
        )
        self.image_root, self.allow_images = image_root, allow_images

    def __call__(self, dataset: Dataset, split: str) -> list[_Example]:
        if len(dataset) == 0:
            return []
        require_columns(dataset, self.columns, f"the {split} split")
        prompt_column, *completion_columns = self.columns
        completions = [self._encode(dataset, column, split) for column in completion_columns]
        cells = (
            dataset[IMAGES_COLUMN]
            if IMAGES_COLUMN in dataset.column_names
            else [None] * len(dataset)
        )
        examples = []
        for index, (prompt, cell) in enumerate(zip(dataset[prompt_column], cells, strict=True)):
            messages = _messages(prompt, index, split)
            shown = self._shown(messages, cell, f"{split} row {index}")
            if shown is None:
                prompt_ids = apply_chat_template(
                    self.tokenizer, messages, add_generation_prompt=True, **self.kwargs
                )
            else:
                assert self.images is not None  # _shown refuses images to a text-only policy
                prompt_ids = self.images.prompt(shown)[0]
            kept = [self.budget.fit(len(prompt_ids), ids[index]) for ids in completions]
            if all(ids is not None for ids in kept):
                sequences = tuple(prompt_ids + ids for ids in kept if ids is not None)
                examples.append(_Example(len(prompt_ids), sequences, shown))
        if len(examples) < len(dataset):
            logger.info(
                "%s split: dropped %d of %d rows with too little response left within the "
                "context budget",
                split,
                len(dataset) - len(examples),
                len(dataset),
            )
        return examples

    def _shown(
        self, messages: list[dict[str, Any]], cell: Any, where: str
    ) -> tuple[dict[str, Any], ...] | None:
        """The prompt's messages showing the row's images, decoded; None if it shows none."""
        values = image_values(cell)
        if not values:
            return None
        count = image_count(len(values))
        if not self.allow_images:
            raise DatasetError(
                f"{where} shows {count}, but preference (DPO) training on images is not "
                "supported yet: drop the rows' `images` column, or train with SFT"
            )
        if self.images is None:
            raise ImageObservationError(
                f"{where} shows {count} but the policy is text-only: train a vision-language "
                "model (model.builtin: tiny_vlm, or a model.path with a vision_config; "
                "DatasetEnv's vision_processor), or drop the rows' `images` column"
            )
        images = decode_cell(values, where=where, root=self.image_root)
        return tuple(show_images(messages, images, where=where))

    def _encode(self, dataset: Dataset, column: str, split: str) -> list[list[int]]:
        """Each row's ``column`` text as ids, as the template renders an assistant turn's
        content after its prompt, closed by the template's own end of turn (``<|im_end|>``,
        ``<end_of_turn>``...: what the model samples to stop, the same ids the harness
        uses)."""
        texts = list(dataset[column])
        for index, text in enumerate(texts):
            if not isinstance(text, str):
                raise DatasetError(
                    f"{split} row {index}: column {column!r} holds "
                    f"{type(text).__name__} {text!r}; expected a string"
                )
        gap = self.framer.content_gap
        encoded = self.framer.encode_continuations([gap + text for text in texts])
        return [[*ids, *self.end_of_turn] for ids in encoded]


def _messages(prompt: Any, index: int, split: str) -> list[dict[str, Any]]:
    """The chat messages of a prompt cell: a string becomes one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if (
        isinstance(prompt, Sequence)
        and prompt
        and all(isinstance(m, Mapping) and "role" in m for m in prompt)
    ):
        # Arrow gives every message every key of the column's struct; absent ones are None.
        return [{k: v for k, v in m.items() if v is not None} for m in prompt]
    raise DatasetError(
        f"{split} row {index}: 'prompt' holds {type(prompt).__name__} {prompt!r}; expected "
        "a string or a list of chat messages ({'role': ..., 'content': ...})"
    )


def _eos_id(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DatasetError(
            "the tokenizer has no eos token to close each response; set tokenizer.eos_token"
        )
    return int(eos)


def _pad_id(tokenizer: Any) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return _eos_id(tokenizer) if pad is None else int(pad)
