"""The eval config a training run ends with: its final checkpoint, greedy, on its own env.

``agile-llmenvs train`` writes it as ``<output_dir>/eval.yaml`` and ends by printing
``agile-llmenvs eval <output_dir>/eval.yaml``. The env is the one the run trained on, named
through the manifest the run stored in its folder (``source: manifest``, every path in it
absolute), so the eval plays it exactly as training built it: the same rows and rubric, or the
same entrypoint, ``env_config`` and turn budget. The tasks are held out where the env has any:

* dataset rows with a rubric: the test split (the manifest's ``train_test_split``, or the
  dataset's own), else, when nothing was held out, the rows trained on;
* an entrypoint: ``training.eval_tasks`` tasks seeded as training's own held-out evaluation
  seeds them, apart from the training tasks.

Served envs (``env_url``, ``env_image``) and dataset envs (teacher-forced SFT or DPO rows)
have nothing an eval config can name; :func:`unevaluable_reason` says why.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import yaml

from agile_llmenvs._run_files import EVAL_CONFIG, RUN_MANIFEST
from agile_llmenvs.config import EvalConfig
from agile_llmenvs.specs import LLMEnvSpec
from agile_llmenvs.training.run import RunSettings, TrainResult

__all__ = ["eval_config_for", "unevaluable_reason", "write_eval_config"]


def unevaluable_reason(spec: LLMEnvSpec) -> str | None:
    """Why no eval config can play the env a run trained on (``None`` when one can)."""
    if spec.env_type != "rollout":
        return (
            f"its env is a dataset env (teacher-forced {spec.objective} rows, no episodes to play)"
        )
    if spec.source in ("env_url", "env_image"):
        return f"its env is served ({spec.source}), and an eval config names no served env"
    return None


def eval_config_for(settings: RunSettings, result: TrainResult) -> EvalConfig:
    """The eval config of a finished run (what :func:`write_eval_config` writes).

    Raises:
        ValueError: :func:`unevaluable_reason` names a reason.
        DatasetError: The env's rows cannot be read (to count the held-out ones).
    """
    data, _ = _eval_config_data(settings, result)
    return EvalConfig.model_validate(data)


def write_eval_config(settings: RunSettings, result: TrainResult) -> Path:
    """Write the eval config of a finished run as ``<output_dir>/eval.yaml``; returns its path.

    Run it with ``agile-llmenvs eval <output_dir>/eval.yaml``.

    Raises:
        ValueError: :func:`unevaluable_reason` names a reason.
        DatasetError: The env's rows cannot be read.
        OSError: The file cannot be written.
    """
    data, tasks = _eval_config_data(settings, result)
    EvalConfig.model_validate(data)  # what is written loads
    run = Path(result.output_dir)
    path = run / EVAL_CONFIG
    about = (
        f"Written by `agile-llmenvs train` for the run in {run.resolve()}: its checkpoint "
        f"{Path(data['model']['model']).name}, greedy, on the env it trained on (the manifest it "
        f"ran, {RUN_MANIFEST} in its folder), playing {tasks}."
    )
    lines = [
        *textwrap.wrap(about, width=92),
        f"  agile-llmenvs eval {path.resolve()}",
        "`--limit N` plays the first N tasks; `--model tiny` scores the untrained tiny model.",
    ]
    comment = "".join(f"# {line}\n" for line in lines)
    path.write_text(comment + yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _eval_config_data(settings: RunSettings, result: TrainResult) -> tuple[dict[str, Any], str]:
    """The eval config as YAML-ready data, and which tasks it plays, in words."""
    spec = settings.env
    reason = unevaluable_reason(spec)
    if reason is not None:
        raise ValueError(f"no eval config for this run: {reason}")
    run = Path(result.output_dir).resolve()
    environment: dict[str, Any] = {
        "name": settings.manifest.name or spec.label,
        "source": "manifest",
        "manifest": str(run / RUN_MANIFEST),
    }
    if spec.source == "dataset":
        tasks, split, which = _dataset_tasks(spec, settings.seed)
        environment |= {"split": split, "size": tasks, "max_steps": 1}
    else:
        tasks = settings.held_out.tasks
        environment |= {
            "size": tasks,
            "seed": _held_out_seed(settings.seed),
            "max_steps": _turn_budget(spec),
        }
        which = (
            "tasks (training.eval_tasks) seeded as training's held-out evaluation seeds "
            "them, apart from the tasks it trained on"
        )
    model: dict[str, Any] = {
        "backend": "huggingface",
        "model": str(Path(result.checkpoint_dir or run).resolve()),
    }
    if _cuda():
        model["device"] = "cuda"
    data = {
        "environments": [environment],
        "model": model,
        "inference": {"temperature": 0.0, "max_tokens": settings.sampling.max_tokens},
    }
    return data, f"{tasks} {which}"


def _dataset_tasks(spec: LLMEnvSpec, seed: int) -> tuple[int, str, str]:
    """How many rows to play, the split they are in, and which rows those are, in words."""
    from agile_llmenvs.llm_envs.rows import load_rows

    train, test = load_rows(spec, seed)
    if len(test):
        return len(test), "test", "held-out test rows"
    return len(train), "train", "rows it trained on (it held none out: no train_test_split)"


def _held_out_seed(seed: int) -> int:
    """The reset seed of training's first held-out task; task ``i``'s is this plus ``i``."""
    from agile_llmenvs.llm_envs.tasks import TaskAssigner
    from agile_llmenvs.training.grpo import EVAL_SEED_OFFSET

    return TaskAssigner(0, seed=seed + EVAL_SEED_OFFSET).next_task().seed


def _turn_budget(spec: LLMEnvSpec) -> int:
    """The turns an episode of the entrypoint env had in training: ``env.max_turns``, or the
    env's own ``max_turns`` (1 for a text env that declares none)."""
    if spec.max_turns is not None:
        return spec.max_turns
    from agile_llmenvs.llm_envs.from_spec import env_turn_budget
    from agile_llmenvs.transport.resolve import env_factory

    assert spec.entrypoint is not None  # a rollout env of neither rows nor a server
    probe = env_factory(spec.entrypoint, spec.env_config, factory=spec.factory)()
    try:
        return env_turn_budget(probe, label=spec.entrypoint)
    finally:
        close = getattr(probe, "close", None)
        if callable(close):
            close()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
