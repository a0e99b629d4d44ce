"""``agile-llmenvs eval`` for a newcomer: --limit, --max-tokens, the overall row, small
results files, progress lines a log can hold, and a training run's checkpoint as the model."""

from __future__ import annotations

import argparse
import io
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from fakes import ChatAPIServer, DigitEnvFactory

from agile_llmenvs.backends import HFBackend, SamplingParams
from agile_llmenvs.config import EnvironmentConfig, EnvironmentFactory
from agile_llmenvs.core import from_text_env
from agile_llmenvs.evaluation import (
    MultiEvalEntry,
    Progress,
    RunnerConfig,
    TrajectoryRunner,
    run_evaluation,
    run_multi_evaluation,
)
from agile_llmenvs.evaluation.command import register
from agile_llmenvs.evaluation.progress import ProgressDisplay, format_progress
from agile_llmenvs.specs import LoRASpec, ModelSpec, TrainingSpec, dump_manifest, load_manifest

ROOT = Path(__file__).resolve().parents[2]

TWO_ENVS = """\
environments:
  - {{name: even, source: entry_point, entry_point: "fakes:DigitEnv", size: 4}}
  - {{name: short, source: entry_point, entry_point: "fakes:DigitEnv", size: 2}}
model: {{backend: openai, model: m, base_url: "{url}"}}
inference: {{temperature: 0.0, max_tokens: 4}}
"""

ONE_ENV = """\
environments:
  - {{name: digits, source: entry_point, entry_point: "fakes:DigitEnv", size: 6}}
model: {{backend: openai, model: m, base_url: "{url}"}}
inference: {{temperature: 0.0, max_tokens: 4}}
"""


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agile-llmenvs")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.run(args))


def write(tmp_path: Path, text: str, name: str = "eval.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def table_rows(out: str) -> list[list[str]]:
    """The table's data rows (after the header and its rule), as cells."""
    lines = out.splitlines()
    end = next((i for i, line in enumerate(lines) if line.startswith("wrote ")), len(lines))
    return [line.split() for line in lines[2:end]]


# --------------------------------------------------------------------------- flags


def test_limit_runs_the_first_tasks_of_each_environment(
    tmp_path: Path, server: ChatAPIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path, TWO_ENVS.format(url=server.openai_url))
    output = tmp_path / "results.json"
    assert run(["eval", str(config), "--limit", "3", "--output", str(output)]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert [row[:2] for row in rows] == [["even", "3"], ["short", "2"], ["overall", "5"]]
    assert len(server.requests) == 5
    report = json.loads(output.read_text(encoding="utf-8"))
    assert report["limit"] == 3
    tasks = [[t["task_index"] for t in env["trajectories"]] for env in report["environments"]]
    assert tasks == [[0, 1, 2], [0, 1]]


def test_limit_and_max_tokens_must_be_positive(
    tmp_path: Path, server: ChatAPIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path, ONE_ENV.format(url=server.openai_url))
    assert run(["eval", str(config), "--limit", "0"]) == 2
    assert capsys.readouterr().err == "error: --limit must be >= 1, got 0\n"
    assert run(["eval", str(config), "--max-tokens", "-2"]) == 2
    assert capsys.readouterr().err == "error: --max-tokens must be >= 1, got -2\n"
    assert server.requests == []


def test_max_tokens_overrides_the_config(
    tmp_path: Path, server: ChatAPIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path, ONE_ENV.format(url=server.openai_url))
    output = tmp_path / "results.json"
    assert run(["eval", str(config), "--max-tokens", "2", "--output", str(output)]) == 0
    assert {r.body["max_completion_tokens"] for r in server.requests} == {2}
    report = json.loads(output.read_text(encoding="utf-8"))
    assert report["config"]["inference"]["max_tokens"] == 2  # the results say what ran


def test_one_environment_still_gets_the_overall_row(
    tmp_path: Path, server: ChatAPIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    server.reply = lambda messages: "0"  # right for row 0 only
    config = write(tmp_path, ONE_ENV.format(url=server.openai_url))
    assert run(["eval", str(config)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "environment  tasks  accuracy  mean reward  mean steps  errors",
        "-----------  -----  --------  -----------  ----------  ------",
        "digits           6     16.7%        0.167        1.00       0",
        "overall          6     16.7%        0.167        1.00       0",
    ]


# --------------------------------------------------------------------------- results file


def test_results_files_cut_long_texts_and_leave_ids_out(
    tmp_path: Path, server: ChatAPIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    server.reply = lambda messages: "\n" * 5000  # what a random model writes
    config = write(tmp_path, ONE_ENV.format(url=server.openai_url))
    output = tmp_path / "results.json"
    assert run(["eval", str(config), "--output", str(output)]) == 0
    size = output.stat().st_size
    assert size < 6 * 3000, size  # uncut, each trajectory holds 2 x 10,000 escaped chars
    report = json.loads(output.read_text(encoding="utf-8"))
    assert report["config"]["results"] == {"max_text_chars": 500, "token_ids": False}
    [trajectory, *_] = report["environments"][0]["trajectories"]
    assert trajectory["actions"] == ["\n" * 500 + "…[+4500 chars]"]
    assert trajectory["messages"][1] == {
        "role": "assistant",
        "content": "\n" * 500 + "…[+4500 chars]",
    }
    assert "token_ids" not in trajectory


def test_max_text_chars_is_a_config_field(
    tmp_path: Path, server: ChatAPIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    server.reply = lambda messages: "abcdef"
    text = ONE_ENV.format(url=server.openai_url) + "results: {max_text_chars: 2}\n"
    output = tmp_path / "results.json"
    assert run(["eval", str(write(tmp_path, text)), "--output", str(output)]) == 0
    report = json.loads(output.read_text(encoding="utf-8"))
    assert report["environments"][0]["trajectories"][0]["actions"] == ["ab…[+4 chars]"]


def test_token_ids_are_written_when_asked(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(
        tmp_path,
        'environments: [{name: d, source: entry_point, entry_point: "fakes:DigitEnv", size: 2}]\n'
        f"model: {{backend: huggingface, model: '{tiny_model_dir}'}}\n"
        "inference: {temperature: 0.0, max_tokens: 3}\n",
    )
    plain, with_ids = tmp_path / "plain.json", tmp_path / "ids.json"
    assert run(["eval", str(config), "--output", str(plain)]) == 0
    assert run(["eval", str(config), "--output", str(with_ids), "--token-ids"]) == 0
    [first, *_] = json.loads(plain.read_text(encoding="utf-8"))["environments"][0]["trajectories"]
    assert "token_ids" not in first
    report = json.loads(with_ids.read_text(encoding="utf-8"))
    assert report["config"]["results"]["token_ids"] is True
    [ids] = report["environments"][0]["trajectories"][0]["token_ids"]
    assert 1 <= len(ids) <= 3
    assert all(isinstance(i, int) for i in ids)


# --------------------------------------------------------------------------- progress


def test_progress_is_plain_lines_outside_a_terminal(
    tmp_path: Path, server: ChatAPIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path, TWO_ENVS.format(url=server.openai_url))
    assert run(["eval", str(config)]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    # 6 tasks of up to 10 steps each; they all end after one
    assert lines[0].startswith("eval:   0% | 0/60 steps | 0/6 trajectories | 0:00 elapsed, ETA ?")
    assert lines[-1].startswith("eval: 100% | 6/6 steps | 6/6 trajectories | ")
    assert all(line.startswith("eval: ") for line in lines)


def test_progress_counts_steps_before_any_trajectory_ends(server: ChatAPIServer) -> None:
    from agile_llmenvs.backends import OpenAIBackend

    backend = OpenAIBackend("m", base_url=server.openai_url)
    # row 0 lasts 3 turns, row 1 one; the budget is 10 steps each
    env = from_text_env(DigitEnvFactory(turns=lambda row: 3 if row == 0 else 1))
    runner = TrajectoryRunner(env, backend, config=RunnerConfig(max_steps=10))
    seen: list[Progress] = []
    run_multi_evaluation([MultiEvalEntry(runner, [0, 1])], on_step=seen.append)
    backend.close()
    assert [(p.steps, p.max_steps, p.completed, p.total) for p in seen] == [
        (0, 20, 0, 2),  # before the first step
        (2, 11, 1, 2),  # row 1 ended after 1 of its 10 steps
        (3, 11, 1, 2),  # row 0 is on: the ETA needs no finished trajectory
        (4, 4, 2, 2),  # row 0 terminated after 3
    ]


def test_the_eta_comes_from_steps_done() -> None:
    progress = Progress(steps=10, max_steps=40, tokens=640, completed=0, total=8)
    assert format_progress(progress, elapsed_s=20.0) == (
        "eval:  25% | 10/40 steps | 0/8 trajectories | 640 tokens (32/s) | 0:20 elapsed, ETA 1:00"
    )


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_outside_a_terminal_a_line_every_interval() -> None:
    stream, clock = io.StringIO(), _Clock()
    display = ProgressDisplay(stream, interval_s=5.0, clock=clock)
    for second, steps in [(0, 0), (1, 1), (3, 2), (6, 3), (7, 4), (8, 5)]:
        clock.now = second
        display(Progress(steps, 5, 0, 0 if steps < 5 else 1, 1))
    display.close()
    lines = stream.getvalue().splitlines()
    assert [line.split(" | ")[1] for line in lines] == ["0/5 steps", "3/5 steps", "5/5 steps"]
    assert "\r" not in stream.getvalue()


def test_on_a_terminal_the_line_is_redrawn() -> None:
    stream, clock = _Terminal(), _Clock()
    display = ProgressDisplay(stream, clock=clock)
    display(Progress(0, 2, 0, 0, 2))
    display(Progress(2, 2, 0, 2, 2))
    display.close()
    text = stream.getvalue()
    assert text.count("\r") == 2
    assert text.endswith("2/2 steps | 2/2 trajectories | 0:00 elapsed, ETA 0:00\n")


# --------------------------------------------------------------------------- checkpoints


def _train(tiny_model_dir: Path, output_dir: Path, **training: Any) -> Path:
    """A two-step GRPO run of the quick start (dense digit reward), checkpointed each step;
    returns its manifest."""
    from agile_llmenvs.training import train_grpo

    manifest = load_manifest(ROOT / "manifests" / "quickstart.yaml")
    assert manifest.training is not None
    settings = {
        **manifest.training.model_dump(exclude_unset=True),
        "max_steps": 2,
        "save_every": 1,
        "batch_size": 2,
        "group_size": 4,
        "max_new_tokens": 4,
        "learning_rate": 0.05,
        "output_dir": str(output_dir),
        **training,
    }
    env = manifest.env.model_copy(
        update={
            "rubric_file_path": str(ROOT / "tests" / "training" / "rubrics.py"),
            "rubric_name": "digit_share",
        }
    )
    manifest = manifest.model_copy(
        update={
            "model": ModelSpec(path=str(tiny_model_dir)),
            "env": env,
            "training": TrainingSpec.model_validate(settings),
        }
    )
    train_grpo(manifest)
    path = output_dir.parent / f"{output_dir.name}.yaml"
    dump_manifest(manifest, path)
    return path


def _eval_config(tmp_path: Path, manifest: Path, model: Path) -> Path:
    return write(
        tmp_path,
        f"environments: [{{name: digits, source: manifest, manifest: '{manifest}'}}]\n"
        f"model: {{backend: huggingface, model: '{model}'}}\n"
        "inference: {temperature: 0.0, max_tokens: 4}\n",
        name=f"eval-{model.name}.yaml",
    )


def _cli_report(config: Path, *flags: str) -> dict[str, Any]:
    output = config.with_suffix(".json")
    assert run(["eval", str(config), "--output", str(output), *flags]) == 0
    report: dict[str, Any] = json.loads(output.read_text(encoding="utf-8"))
    return report


def _direct(manifest: Path, backend: HFBackend) -> tuple[float, list[list[str]]]:
    env = EnvironmentFactory.create(
        EnvironmentConfig(name="digits", source="manifest", manifest=str(manifest))
    )
    result = run_evaluation(env, backend, SamplingParams(max_tokens=4, temperature=0.0))
    return result.mean_reward, [[turn.action.text for turn in t.turns] for t in result.trajectories]


def _scored(report: dict[str, Any]) -> tuple[float, list[list[str]]]:
    [env] = report["environments"]
    return env["mean_reward"], [t["actions"] for t in env["trajectories"]]


def test_a_training_run_is_a_model(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    manifest = _train(tiny_model_dir, run_dir)
    newest = _direct(manifest, _loaded(run_dir / "checkpoint-2" / "model"))
    assert newest != _direct(manifest, HFBackend(tiny_model_dir))  # training changed it

    from_run = _cli_report(_eval_config(tmp_path, manifest, run_dir))
    assert _scored(from_run) == newest  # the run folder stands for its newest checkpoint
    assert from_run["overall"]["num_tasks"] == 10  # the manifest's rows, all of them
    config = _eval_config(tmp_path, manifest, tiny_model_dir)
    first = _cli_report(config, "--model", str(run_dir / "checkpoint-1"))
    assert _scored(first) == _direct(manifest, _loaded(run_dir / "checkpoint-1" / "model"))


def _loaded(model_dir: Path) -> HFBackend:
    """The weights of ``model_dir`` loaded directly, with transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return HFBackend.from_model(model, AutoTokenizer.from_pretrained(model_dir))


def test_a_lora_run_is_its_adapters_on_the_base_model(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = tmp_path / "lora-run"
    manifest = _train(tiny_model_dir, run_dir, lora=LoRASpec(r=4, alpha=8), learning_rate=0.1)
    adapters = run_dir / "checkpoint-2" / "model"
    assert (adapters / "adapter_config.json").is_file()
    base_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with warnings.catch_warnings():  # peft asks transformers 5 a question it has renamed
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        policy = PeftModel.from_pretrained(base_model, adapters).eval()  # adapters unmerged
    direct = _direct(
        manifest, HFBackend.from_model(policy, AutoTokenizer.from_pretrained(adapters))
    )
    assert direct != _direct(manifest, HFBackend(tiny_model_dir))

    assert _scored(_cli_report(_eval_config(tmp_path, manifest, run_dir))) == direct


def test_a_run_folder_without_a_complete_checkpoint_is_refused(
    tmp_path: Path, server: ChatAPIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "checkpoint-3.partial" / "model").mkdir(parents=True)  # a save cut short
    config = write(tmp_path, ONE_ENV.format(url=server.openai_url))
    assert run(["eval", str(config), "--model", str(run_dir)]) == 0  # an API model: a name
    text = ONE_ENV.format(url=server.openai_url).replace("backend: openai", "backend: huggingface")
    assert run(["eval", str(write(tmp_path, text)), "--model", str(run_dir)]) == 2
    assert capsys.readouterr().err.endswith(
        f"error: model: the run folder {run_dir} has no complete checkpoint (only partial or "
        "damaged ones); name a checkpoint-<step> folder, or train until one is saved\n"
    )
