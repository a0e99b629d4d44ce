"""``train`` ends by writing ``<output_dir>/eval.yaml`` and printing the ``eval`` command that
runs it: the final checkpoint, greedy, on the run's own env, on held-out tasks."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from agile_llmenvs.cli import main
from agile_llmenvs.config import EvalConfig
from agile_llmenvs.specs import LLMEnvSpec, load_manifest
from agile_llmenvs.training.eval_config import eval_config_for, unevaluable_reason
from agile_llmenvs.training.run import RunSettings, TrainResult

ROOT = Path(__file__).resolve().parents[2]
OWN_ENV = ROOT / "examples" / "own_env"


@pytest.fixture
def own_env(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """docs/own_env.md's files (env and manifest) where the guide has them, run for 2 steps on
    the session's tiny model, from the folder above ``examples/`` as the guide runs them."""
    folder = tmp_path / "examples" / "own_env"
    shutil.copytree(OWN_ENV, folder, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    data = yaml.safe_load((folder / "guess.yaml").read_text())
    data["model"] = {"path": str(tiny_model_dir)}
    data["training"]["max_steps"] = 2
    (folder / "guess.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_train_ends_with_the_eval_command_of_its_own_config_and_it_runs(
    own_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "examples/own_env/guess.yaml"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.endswith(
        "; files in runs/guess-digit. Evaluate with: agile-llmenvs eval runs/guess-digit/eval.yaml"
    ), last
    run = own_env / "runs" / "guess-digit"
    written = yaml.safe_load((run / "eval.yaml").read_text())
    assert written == {
        "environments": [
            {
                "name": "guess-digit",
                "source": "manifest",
                "manifest": str(run / "manifest.yaml"),
                "size": 16,  # training.eval_tasks
                "seed": (7_919 * 1_000_003) % (2**31 - 1),  # training's held-out task stream
                "max_steps": 3,  # the env's max_turns
            }
        ],
        "model": {"backend": "huggingface", "model": str(run / "checkpoint-2")},
        "inference": {"temperature": 0.0, "max_tokens": 4},
    }

    command = shlex.split(last.split("Evaluate with: ")[1])
    assert command[:2] == ["agile-llmenvs", "eval"]
    assert main([*command[1:], "--output", "results.json"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == [
        *("environment", "tasks", "accuracy", "mean", "reward", "mean", "steps", "errors")
    ]
    assert table[2].split()[:2] == ["guess-digit", "16"]
    results = json.loads((own_env / "results.json").read_text())
    [env] = results["environments"]
    assert (env["num_tasks"], env["num_errors"]) == (16, 0)
    for episode in env["trajectories"]:
        assert 1 <= episode["num_steps"] <= 3
        assert episode["total_reward"] == pytest.approx(sum(episode["rewards"]))
    rewards = [episode["total_reward"] for episode in env["trajectories"]]
    assert env["mean_reward"] == pytest.approx(sum(rewards) / 16)

    before = (run / "eval.yaml").stat().st_mtime_ns
    assert main(["train", "examples/own_env/guess.yaml", "--resume"]) == 0  # complete already
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.endswith("Evaluate with: agile-llmenvs eval runs/guess-digit/eval.yaml"), last
    assert (run / "eval.yaml").stat().st_mtime_ns == before  # the run is left untouched


def test_a_dataset_env_is_evaluated_on_its_held_out_rows(tmp_path: Path) -> None:
    quickstart = load_manifest(ROOT / "manifests" / "quickstart.yaml")
    result = TrainResult(tmp_path / "run", 3, checkpoint_dir=tmp_path / "run" / "checkpoint-3")
    [trained_rows] = eval_config_for(RunSettings.of(quickstart), result).environments
    assert (trained_rows.split, trained_rows.size, trained_rows.max_steps) == ("train", 10, 1)

    env = quickstart.env.model_copy(update={"train_test_split": 0.2})
    config = eval_config_for(RunSettings.of(quickstart.model_copy(update={"env": env})), result)
    [held_out] = config.environments
    assert (held_out.source, held_out.manifest) == ("manifest", str(tmp_path / "run/manifest.yaml"))
    assert (held_out.split, held_out.size) == ("test", 2)
    assert config.model.model == str(tmp_path / "run" / "checkpoint-3")
    assert (config.inference.temperature, config.inference.max_tokens) == (0.0, 8)
    assert isinstance(config, EvalConfig)


def test_envs_an_eval_config_cannot_play_are_named() -> None:
    sft = load_manifest(ROOT / "manifests" / "sft_digits.yaml").env
    served = load_manifest(ROOT / "manifests" / "rollout_remote.yaml").env
    assert isinstance(sft, LLMEnvSpec)
    assert isinstance(served, LLMEnvSpec)
    assert unevaluable_reason(sft) == (
        "its env is a dataset env (teacher-forced sft rows, no episodes to play)"
    )
    assert unevaluable_reason(served) == (
        "its env is served (env_url), and an eval config names no served env"
    )
