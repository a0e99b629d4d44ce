"""Real tokenizers that load offline: the SentencePiece models the ``mistral-common`` package
ships (a test-only dependency), loaded as Hugging Face ``LlamaTokenizer`` s.

Their pieces use ``▁`` for spaces and fall back to bytes, so framing is checked on real merges,
not only on special-token boundaries. None has a chat template: give it one
(``template_corpus.with_template``).
"""

from __future__ import annotations

import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["MISTRAL_MODELS", "load_mistral_tokenizer", "mistral_tokenizer_dir"]

#: Short name -> file under ``mistral_common/data``.
MISTRAL_MODELS = {
    "mistral_v1": "tokenizer.model.v1",  # 32,000 pieces; [INST] is plain text
    "mistral_v3": "mistral_instruct_tokenizer_240323.model.v3",  # [INST] etc. are control ids
}


@cache
def mistral_tokenizer_dir(name: str) -> Path:
    """A folder holding the ``name`` model as ``tokenizer.model`` (made once per process)."""
    import mistral_common

    source = Path(mistral_common.__file__).parent / "data" / MISTRAL_MODELS[name]
    folder = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    shutil.copy(source, folder / "tokenizer.model")
    return folder


def load_mistral_tokenizer(name: str) -> Any:
    """A fresh ``LlamaTokenizer`` of the ``name`` model (``legacy=False``: no space is added
    after special tokens)."""
    from transformers import LlamaTokenizer

    return LlamaTokenizer.from_pretrained(mistral_tokenizer_dir(name), legacy=False)
