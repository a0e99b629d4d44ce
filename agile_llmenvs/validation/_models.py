"""The checks of a model: a local model folder whose config and tokenizer load offline, a
backend's package and API key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from agile_llmenvs.errors import ManifestError
from agile_llmenvs.specs import ModelSpec
from agile_llmenvs.validation._problems import Found, Problem, installed

__all__ = ["check_eval_model", "check_model"]

_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")
_API_KEY_ENV = {
    "openai": "OPENAI_API_KEY",
    "anthropic": "ANTHROPIC_API_KEY",
    "openrouter": "OPENROUTER_API_KEY",
}


def check_model(found: Found, spec: ModelSpec) -> None:
    """A model path is a local folder whose config and tokenizer (or processor) load offline;
    the built-in model (no path) is built locally when a run starts, so it is not checked."""
    from agile_llmenvs.backends.hf import check_model_dir

    model_found = False
    if spec.path is not None:
        path = spec.path
        model_found = found.attempt("model.path", lambda: check_model_dir(path, field="model.path"))
    tokenizer = spec.tokenizer_path
    tokenizer_found = tokenizer is None or any(
        (Path(tokenizer) / f).is_file() for f in _TOKENIZER_FILES
    )
    if not tokenizer_found:
        found.append(
            Problem(
                "model.tokenizer_path",
                f"{tokenizer!r} is not a tokenizer folder (it holds no {_TOKENIZER_FILES[0]}); "
                "set it to the folder save_pretrained writes, or unset it to use the model's",
            )
        )
    if spec.path is None or not model_found or not (Path(spec.path) / "config.json").is_file():
        return  # no model folder, or LoRA adapters (their base model is named inside)
    model = spec.path
    if found.attempt("model.path", lambda: _config_loads(model)) and tokenizer_found:
        where = "model.tokenizer_path" if tokenizer else "model.path"
        found.attempt(where, lambda: _tokenizer_loads(model, tokenizer))


def _config_loads(path: str) -> None:
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises ValueError, OSError and more
        text = " ".join(str(exc).split())
        if "`model_type`" in text:
            raise ManifestError(
                f"{path!r}: config.json has no model_type: not a transformers model folder; set "
                "model.path to the folder save_pretrained writes (its config.json names a "
                'model_type, e.g. "qwen2")'
            ) from exc
        raise ManifestError(
            f"{path!r}: config.json does not load ({type(exc).__name__}: {text}); set model.path "
            "to the folder save_pretrained writes"
        ) from exc


def _tokenizer_loads(path: str, tokenizer_path: str | None) -> None:
    """The tokenizer training loads loads (the processor, for a vision-language model)."""
    from agile_llmenvs.tiny_vlm import is_vision_model, load_processor

    folder = tokenizer_path or path
    what = "tokenizer"
    fix = (
        f"save it into that folder ({what}.save_pretrained(folder)), or set "
        "model.tokenizer_path to a folder that holds one"
    )
    if not any((Path(folder) / name).is_file() for name in _TOKENIZER_FILES):
        # transformers would make an empty tokenizer of the config's class instead
        raise ManifestError(
            f"{folder!r} holds no tokenizer (no {', '.join(_TOKENIZER_FILES)}); {fix}"
        )
    try:
        if tokenizer_path is None and is_vision_model(path):
            what = "processor"
            load_processor(path)
        else:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError and more
        text = " ".join(str(exc).split())
        fix = fix.replace("tokenizer.save", f"{what}.save")
        raise ManifestError(
            f"{folder!r}: the {what} does not load ({type(exc).__name__}: {text}); {fix}"
        ) from exc


def check_eval_model(found: Found, model: Any) -> None:
    """An eval config's model: a local model folder, or an API backend's SDK and key."""
    from agile_llmenvs.backends.hf import check_model_dir
    from agile_llmenvs.config.models import TINY_MODEL, TINY_VLM_MODEL

    if model.backend == "vllm":
        found.attempt("model.backend", installed("vllm", "vllm", "the vllm backend"))
    if model.backend in ("huggingface", "vllm"):
        if model.model not in (TINY_MODEL, TINY_VLM_MODEL):
            from agile_llmenvs.config.factories import model_directory

            path = model.model  # a training run's folder or checkpoint stands for its model
            found.attempt(
                "model.model",
                lambda: check_model_dir(model_directory(path), field="model.model"),
            )
        return
    sdk = "anthropic" if model.backend == "anthropic" else "openai"
    found.attempt("model.backend", installed(sdk, "api", f"the {model.backend} backend"))
    variable = model.api_key_env or _API_KEY_ENV[model.backend]
    if model.base_url is None and not os.environ.get(variable):
        found.append(
            Problem(
                "model.api_key_env" if model.api_key_env else "model.backend",
                f"the API key's environment variable {variable} is not set; export it, or "
                "name the variable that holds the key in model.api_key_env",
            )
        )
