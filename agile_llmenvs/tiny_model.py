"""A tiny, fully offline causal LM: the package's default model and the fixture of its tests.

:func:`build_tiny_model` trains a byte-level BPE tokenizer (Qwen2's pipeline, ChatML template)
on a corpus generated in code and saves it with a random-init ``Qwen2ForCausalLM`` in float32
safetensors. Nothing is downloaded; equal arguments give byte-identical files.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agile_llmenvs._cache import cache_root
from agile_llmenvs.errors import AgileLLMEnvsError

__all__ = [
    "CHAT_TEMPLATE",
    "MARKER_FILE",
    "SPECIAL_TOKENS",
    "TinyModelError",
    "build_tiny_model",
    "default_tiny_model_dir",
    "ensure_tiny_model",
]

#: Written last into a finished build; records the arguments the build was made with.
MARKER_FILE = "tiny_model.json"
_FORMAT_VERSION = 1  # bump when a change here changes what a build holds
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)

#: ChatML as Qwen renders it, without Qwen's default system prompt. Assistant turns are wrapped
#: in ``{% generation %}`` so ``return_assistant_tokens_mask=True`` works.
CHAT_TEMPLATE = (
    "{%- for message in messages %}{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- generation %}{{- message['content'] + '<|im_end|>' }}"
    "{%- endgeneration %}{{- '\\n' }}{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' "
    "+ message['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2's pre-tokenizer split: every digit is a token of its own.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_WORD_TEXT = (
    "the a an and or not is are was be to of in on at for with from by as it this that what which "
    "who how why when where yes no true false answer question number sum total add plus minus "
    "times equal count step first then next last so because think reason solve check result value "
    "list word letter game move board win lose draw play player turn left right up down red blue "
    "green one two three four five six seven eight nine ten you we they I my your please thank "
    "hello good bad correct wrong final user assistant system tool say find"
)
_WORDS = _WORD_TEXT.split()
_PUNCT = list(".,?!:;'\"()[]{}<>-+*/=#%&_|@$^~`\\")


class TinyModelError(AgileLLMEnvsError, ValueError):
    """A tiny model could not be built where, or how, it was asked for."""


def _corpus(n_lines: int = 3000) -> list[str]:
    """The tokenizer's training text: words, arithmetic, punctuation and chat-like turns."""
    rng = random.Random(1234)
    lines = [" ".join(_WORDS), "".join(_PUNCT), " ".join(_PUNCT), "0 1 2 3 4 5 6 7 8 9"]
    for _ in range(n_lines):
        kind = rng.randrange(4)
        if kind == 0:
            a, b = rng.randrange(100), rng.randrange(100)
            lines.append(f"What is {a} + {b}? The answer is {a + b}.")
        elif kind == 1:
            words = " ".join(rng.choices(_WORDS, k=rng.randint(3, 12)))
            lines.append(words.capitalize() + rng.choice(".?!:;,"))
        elif kind == 2:
            role = rng.choice(("system", "user", "assistant", "tool"))
            lines.append(f"{role}\n{' '.join(rng.choices(_WORDS, k=rng.randint(2, 8)))}\n")
        else:
            tokens = rng.choices(_WORDS + _PUNCT + list("0123456789"), k=rng.randint(3, 10))
            lines.append(rng.choice(("", " ", "\n")).join(tokens))
    return lines


def _build_tokenizer(vocab_size: int) -> Any:
    """Train the byte-level BPE tokenizer and wrap it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # The same pipeline transformers' Qwen2Tokenizer rebuilds when it loads the files.
    affixes: dict[str, Any] = {"continuing_subword_prefix": "", "end_of_word_suffix": ""}
    tok = Tokenizer(models.BPE(**affixes))
    tok.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        **affixes,
    )  # fmt: skip
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT, chat_template=CHAT_TEMPLATE,
        additional_special_tokens=[IM_START], model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )  # fmt: skip


def _build_model(tokenizer: Any, *, seed: int, hidden_size: int, layers: int) -> Any:
    """A random-init ``Qwen2ForCausalLM`` whose special ids match ``tokenizer``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    # As in Qwen, bos is <|endoftext|>, which the tokenizer never adds.
    ids: dict[str, Any] = {"bos_token_id": pad_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, tie_word_embeddings=True, **ids,
    )  # fmt: skip
    config.dtype = torch.float32
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state untouched
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).float().eval()
    model.generation_config = GenerationConfig(**ids)
    return model


def _qwen2_tokenizer_config(path: Path) -> None:
    """Make ``tokenizer_config.json`` load as Qwen's does, alike in transformers 4 and 5.

    ``Qwen2Tokenizer`` rebuilds the very pipeline trained here; as in Qwen, no unknown token;
    ``additional_special_tokens`` is read by both (5 writes a list 4 cannot read).
    """
    config = json.loads(path.read_text(encoding="utf-8"))
    config.update(tokenizer_class="Qwen2Tokenizer", unk_token=None)
    config["additional_special_tokens"] = config.pop("extra_special_tokens", [IM_START])
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _read_marker(path: Path) -> dict[str, Any] | None:
    """The arguments recorded by a finished build in ``path``, or None if there is none."""
    try:
        data = json.loads((path / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def build_tiny_model(
    output_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    vocab_size: int = 450,
    hidden_size: int = 64,
    num_layers: int = 2,
    overwrite: bool = False,
) -> Path:
    """Build the tiny tokenizer and model into ``output_dir``, offline and deterministically.

    The result loads with ``AutoTokenizer``/``AutoModelForCausalLM.from_pretrained``. It is
    built in a sibling temporary directory renamed into place when complete, so an interrupted
    build never looks finished; a directory already holding the same build is returned as is.

    Args:
        output_dir: Where the model goes; created if missing, with its parents.
        seed: Seed of the weight initialisation; equal seeds give byte-identical weights.
        vocab_size: Target vocabulary size of the BPE tokenizer, special tokens included.
        hidden_size: Model width; a multiple of 8 (4 attention heads, even head size).
        num_layers: Number of decoder layers.
        overwrite: Replace whatever ``output_dir`` holds if it is not the same build.

    Returns:
        The absolute path of the finished build.

    Raises:
        TinyModelError: An argument is out of range, or ``output_dir`` holds a different
            build or other files and ``overwrite`` is False.
    """
    if vocab_size < 259 or hidden_size % 8 or min(hidden_size, num_layers) < 1:
        raise TinyModelError(
            "Need vocab_size >= 259 (bytes + special tokens), hidden_size a positive multiple "
            f"of 8 and num_layers >= 1; got {vocab_size}, {hidden_size} and {num_layers}."
        )
    out = Path(output_dir).expanduser().absolute()
    args = {"format_version": _FORMAT_VERSION, "seed": seed, "vocab_size": vocab_size}
    args.update(hidden_size=hidden_size, num_layers=num_layers)
    if _read_marker(out) == args:
        return out
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        found = _read_marker(out)
        raise TinyModelError(
            f"{out} already holds {f'a tiny model built with {found}' if found else 'other files'}"
            f", not the build asked for ({args}). Pass overwrite=True to replace it, or choose "
            "another output_dir."
        )
    build_in_place(out, args, _write_build, overwrite=overwrite)
    return out


def build_in_place(
    out: Path,
    args: dict[str, Any],
    write: Callable[[Path, dict[str, Any]], None],
    *,
    overwrite: bool,
) -> None:
    """Run ``write`` into a sibling temporary directory, write the marker last, then rename it
    to ``out``: an interrupted build never looks finished."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.building-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # unlike mkdtemp, honours the umask: the cache may be shared
    try:
        write(tmp, args)
        (tmp / MARKER_FILE).write_text(json.dumps(args, indent=2) + "\n", encoding="utf-8")
        file_mode = tmp.stat().st_mode & 0o666
        for file in tmp.iterdir():  # some writers create files 0600
            file.chmod(file_mode)
        _move_into_place(tmp, out, args, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_build(tmp: Path, args: dict[str, Any]) -> None:
    """Write the tokenizer and the model into the new directory ``tmp``."""
    tokenizer = _build_tokenizer(args["vocab_size"])
    tokenizer.save_pretrained(tmp)
    _qwen2_tokenizer_config(tmp / "tokenizer_config.json")
    model = _build_model(
        tokenizer, seed=args["seed"], hidden_size=args["hidden_size"], layers=args["num_layers"]
    )
    model.save_pretrained(tmp, safe_serialization=True)


def _move_into_place(tmp: Path, out: Path, args: dict[str, Any], overwrite: bool) -> None:
    """Rename the finished build ``tmp`` to ``out``, replacing ``out`` only if ``overwrite``."""
    try:
        os.replace(tmp, out)  # atomic when ``out`` is missing or an empty directory
        return
    except OSError:
        if _read_marker(out) == args:  # a concurrent build of the same model got there first
            return
        if not overwrite:
            raise
    trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    try:
        os.replace(out, trash / "old")
        os.replace(tmp, out)
    finally:
        shutil.rmtree(trash, ignore_errors=True)


def default_tiny_model_dir() -> Path:
    """Where the default tiny model is cached.

    Returns:
        ``$AGILE_LLMENVS_CACHE/tiny-model-v1`` if that variable is set and non-empty,
        else ``~/.cache/agile_llmenvs/tiny-model-v1``.
    """
    return cache_root() / f"tiny-model-v{_FORMAT_VERSION}"


def ensure_tiny_model() -> Path:
    """Build the default tiny model into :func:`default_tiny_model_dir` unless it is there.

    Returns:
        The directory holding the default build (default arguments, seed 0).
    """
    return build_tiny_model(default_tiny_model_dir())
