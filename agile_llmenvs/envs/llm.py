"""make_llm_env: a dataset spec -> the teacher-forced DatasetEnv (SFT and DPO batches)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from agile_llmenvs.errors import AgileLLMEnvsError, EnvBuildError
from agile_llmenvs.specs import LLMEnvSpec

if TYPE_CHECKING:
    from agile_llmenvs.llm_envs.dataset_env import DatasetEnv

__all__ = ["make_llm_env", "rollout_env_error"]

_DEFAULT_SEED = 42  # DatasetEnv's own default


def make_llm_env(
    spec: LLMEnvSpec,
    tokenizer: Any,
    *,
    data_batch_size_per_gpu: int = 8,
    max_context_length: int | None = None,
    seed: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    vision_processor: Any = None,
) -> DatasetEnv:
    """Build the teacher-forced dataset environment of an LLM spec.

    Rollout envs are built per trajectory instead: use :func:`make_rollout_env_factory`.

    Args:
        spec: The env spec, with ``env_type="dataset"``.
        tokenizer: The tokenizer; ``spec.chat_template_path`` replaces its chat template for
            this env (the tokenizer itself is left as it is).
        data_batch_size_per_gpu: Rows each rank draws per step.
        max_context_length: Token budget a row is truncated to.
        seed: Seed of the train/test split and of the env's row order (None: 42).
        rank: This process's data-parallel rank.
        world_size: Number of data-parallel ranks.
        vision_processor: A vision-language policy's processor: rows' ``images`` are shown
            to it (an image given as a path is relative to ``spec.dataset_path``'s folder).

    Raises:
        AgileLLMEnvsError: ``spec`` is a rollout spec.
        DatasetError: The rows cannot be read or lack a column the objective needs.
        EnvBuildError: ``chat_template_path`` cannot be read.
    """
    from agile_llmenvs.llm_envs.dataset_env import DatasetEnv
    from agile_llmenvs.llm_envs.rows import load_rows

    if spec.env_type != "dataset" or spec.objective is None:
        raise rollout_env_error(spec)
    seed = _DEFAULT_SEED if seed is None else seed
    train, test = load_rows(spec, seed)
    template_kwargs = dict(spec.chat_template_kwargs)
    if spec.chat_template_path is not None:
        template_kwargs["chat_template"] = _read_chat_template(spec.chat_template_path)
    return DatasetEnv(
        train,
        test,
        tokenizer,
        objective=spec.objective,
        response_column=spec.response_column or "response",
        chat_template_kwargs=template_kwargs,
        data_batch_size_per_gpu=data_batch_size_per_gpu,
        max_context_length=max_context_length,
        seed=seed,
        rank=rank,
        world_size=world_size,
        vision_processor=vision_processor,
        image_root=_image_root(spec),
    )


def _image_root(spec: LLMEnvSpec) -> Path | None:
    """The folder of the rows file (or the ``save_to_disk`` folder itself)."""
    if spec.dataset_path is None:
        return None
    path = Path(spec.dataset_path)
    return path if path.is_dir() else path.parent


def _read_chat_template(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise EnvBuildError(f"chat_template_path: cannot read {path!r}: {exc}") from exc


def rollout_env_error(spec: LLMEnvSpec) -> AgileLLMEnvsError:
    """The error :func:`make_env` raises for a rollout spec, which has no single live env."""
    return AgileLLMEnvsError(
        f"{spec.label!r} is a rollout env: each trajectory gets its own env, so build a "
        "factory with make_rollout_env_factory(spec, tokenizer) instead of make_env"
    )
