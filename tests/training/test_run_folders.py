"""Run folders: each manifest its own, never overwritten unasked, resumed only by a manifest
that matches; one rule for paths; and ``train`` output a log can hold (issue #16)."""

from __future__ import annotations

import csv
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from agile_llmenvs._run_files import RUN_LOCK, RUN_MARKER
from agile_llmenvs.cli import main
from agile_llmenvs.errors import CheckpointError
from agile_llmenvs.specs import ModelSpec, RunManifest, TrainingSpec, dump_manifest, load_manifest
from agile_llmenvs.training import train_dpo, train_sft
from agile_llmenvs.training.run import RunFolderLock, RunSettings, manifest_differences, plan_run

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
SFT_RUN, DPO_RUN = Path("runs/digits-sft"), Path("runs/digits-dpo")


def _manifest(model_dir: Path, name: str, **training: Any) -> RunManifest:
    """A shipped manifest on the tiny model; its ``output_dir`` stays unset unless given."""
    manifest = load_manifest(MANIFESTS / name)
    assert manifest.training is not None
    settings = {**manifest.training.model_dump(exclude_unset=True), **training}
    return manifest.model_copy(
        update={
            "model": ModelSpec(path=str(model_dir)),
            "training": TrainingSpec.model_validate(settings),
        }
    )


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder where the shipped SFT (2 steps) and DPO (1 step) manifests were trained one
    after the other, each into its default folder."""
    root = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        train_sft(_manifest(tiny_model_dir, "sft_digits.yaml", max_steps=2, tensorboard=False))
        train_dpo(_manifest(tiny_model_dir, "dpo_digits.yaml", max_steps=1, tensorboard=False))
    return root


@pytest.fixture
def here(runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of ``runs`` (file times kept) as the working directory."""
    shutil.copytree(runs / "runs", tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _steps(run: Path) -> list[int]:
    with (run / "metrics.csv").open(newline="") as file:
        return [int(row["step"]) for row in csv.DictReader(file)]


def _column(run: Path, key: str) -> dict[int, float]:
    with (run / "metrics.csv").open(newline="") as file:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(file)}


def _snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``folder`` with its modification time and content hash, but for the
    lock file, which every process that takes the lock writes its pid into."""
    return {
        str(path.relative_to(folder)): (
            path.stat().st_mtime_ns,
            hashlib.sha256(path.read_bytes()).hexdigest(),
        )
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != RUN_LOCK
    }


def _checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-"))


def _cli(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m agile_llmenvs ARGS`` in ``cwd``, its output piped (not a terminal) and
    decoded as written (text mode would turn carriage returns into newlines)."""
    done = subprocess.run(
        [sys.executable, "-m", "agile_llmenvs", *args],
        cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
        capture_output=True,
        timeout=300,
    )
    return subprocess.CompletedProcess(
        done.args, done.returncode, done.stdout.decode(), done.stderr.decode()
    )


def test_sft_then_dpo_land_in_their_own_folders(runs: Path) -> None:
    assert sorted(p.name for p in (runs / "runs").iterdir()) == ["digits-dpo", "digits-sft"]
    for run, steps, algorithm in ((SFT_RUN, [1, 2], "sft"), (DPO_RUN, [1], "dpo")):
        assert _steps(runs / run) == steps
        assert _checkpoints(runs / run) == [f"checkpoint-{steps[-1]}"]
        stored = yaml.safe_load((runs / run / "manifest.yaml").read_text())
        assert stored["training"]["algorithm"] == algorithm
        assert stored["training"]["output_dir"] == str((runs / run).resolve())
        assert Path(stored["env"]["dataset_path"]).is_absolute()


def test_a_rerun_without_flags_refuses_and_leaves_the_run_as_it_was(
    here: Path, tiny_model_dir: Path
) -> None:
    dump_manifest(_manifest(tiny_model_dir, "sft_digits.yaml", max_steps=2), here / "sft.yaml")
    before = _snapshot(here / SFT_RUN)
    done = _cli("train", "sft.yaml", cwd=here)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr == (
        "error: runs/digits-sft already holds a run (metrics.csv, checkpoint-2): continue it "
        "with --resume, or replace it with --overwrite (--debug shows the traceback)\n"
    )
    assert _steps(here / SFT_RUN) == [1, 2]
    assert _snapshot(here / SFT_RUN) == before


_HOLD_THE_LOCK = """
import sys, time
from pathlib import Path
from agile_llmenvs.training.run import RunFolderLock
lock = RunFolderLock.acquire(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_run_on_a_live_runs_folder_is_refused_naming_its_pid(
    here: Path, tiny_model_dir: Path
) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_THE_LOCK, str(here / SFT_RUN)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "locked\n"
        before = _snapshot(here / SFT_RUN)
        refusal = (
            f"{SFT_RUN} is in use by another run (pid {holder.pid}, which holds "
            f"{SFT_RUN / RUN_LOCK}): wait for that run to end, or give this one another "
            "training.output_dir"
        )
        manifest = _manifest(tiny_model_dir, "sft_digits.yaml", max_steps=3, tensorboard=False)
        for flags in ({"overwrite": True}, {"resume": True}, {}):
            with pytest.raises(CheckpointError) as raised:
                train_sft(manifest, **flags)
            assert str(raised.value) == refusal
        assert _snapshot(here / SFT_RUN) == before
    finally:
        holder.kill()
        holder.wait()
    # the kernel dropped the dead holder's lock: no stale lock blocks the next run
    RunFolderLock.acquire(here / SFT_RUN).release()
    assert train_sft(manifest, resume=True).steps == 3


def test_overwrite_replaces_the_run_and_only_the_run(here: Path, tiny_model_dir: Path) -> None:
    (here / SFT_RUN / "notes.txt").write_text("mine")
    (here / SFT_RUN / "rollouts.jsonl").write_text("{}\n")  # as a GRPO run logs them
    manifest = _manifest(tiny_model_dir, "sft_digits.yaml", max_steps=1, tensorboard=False)
    result = train_sft(manifest, overwrite=True)
    assert result.output_dir == SFT_RUN
    assert _steps(here / SFT_RUN) == [1]
    assert _checkpoints(here / SFT_RUN) == ["checkpoint-1"]  # checkpoint-2 went with its run
    assert (
        yaml.safe_load((here / SFT_RUN / "manifest.yaml").read_text())["training"]["max_steps"] == 1
    )
    assert not (here / SFT_RUN / "rollouts.jsonl").exists()
    assert (here / SFT_RUN / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("flags", [{"overwrite": True}, {}], ids=["overwrite", "fresh"])
def test_a_folder_no_run_wrote_is_left_alone_though_its_files_have_a_runs_names(
    tmp_path: Path, tiny_model_dir: Path, flags: dict[str, bool]
) -> None:
    """W&B's, MLflow's and TensorBoard's default folders, a page and a user's own manifest:
    named as a run's files, written by no run. An overwrite would delete them and a fresh
    start write over the manifest; both are refused and nothing changes."""
    folder = tmp_path / "experiments"
    for name in ("wandb", "mlruns", "tensorboard"):
        (folder / name).mkdir(parents=True)
        (folder / name / "kept.txt").write_text(name)
    (folder / "rollouts.html").write_text("<html></html>")
    (folder / "manifest.yaml").write_text("mine: true\n")
    before = _snapshot(folder)
    manifest = _manifest(tiny_model_dir, "sft_digits.yaml", max_steps=1, output_dir=str(folder))
    with pytest.raises(CheckpointError) as raised:
        train_sft(manifest, **flags)
    assert str(raised.value) == (
        f"{folder} holds manifest.yaml, mlruns, rollouts.html, tensorboard, wandb, named as a "
        "run's files, but no run of this library marked the folder as its own "
        "(.agile-llmenvs-run): a run there would write over them, and --overwrite would delete "
        "them. Give training.output_dir an empty or new folder, or move them out (a run of a "
        "version before the marker: delete its folder yourself, or resume it with --resume)"
    )
    assert _snapshot(folder) == before


def test_a_run_marks_its_folder_and_an_overwrite_removes_the_mark_with_the_run(
    here: Path, tiny_model_dir: Path
) -> None:
    assert (here / SFT_RUN / RUN_MARKER).is_file()
    (here / SFT_RUN / RUN_MARKER).unlink()  # as a folder no run marked
    manifest = _manifest(tiny_model_dir, "sft_digits.yaml", max_steps=1, tensorboard=False)
    with pytest.raises(CheckpointError, match="no run of this library marked the folder"):
        train_sft(manifest, overwrite=True)
    longer = _manifest(tiny_model_dir, "sft_digits.yaml", max_steps=3, tensorboard=False)
    assert train_sft(longer, resume=True).steps == 3  # a resume deletes nothing: it may
    assert (here / SFT_RUN / RUN_MARKER).is_file()  # and it marks the folder
    assert train_sft(manifest, overwrite=True).steps == 1


def test_resume_refuses_the_run_of_another_algorithm(here: Path, tiny_model_dir: Path) -> None:
    dpo_run = here / DPO_RUN
    before = _snapshot(dpo_run)
    sft = _manifest(tiny_model_dir, "sft_digits.yaml", output_dir=str(dpo_run))
    with pytest.raises(CheckpointError) as raised:
        train_sft(sft, resume=True)
    assert str(raised.value) == (
        f"cannot resume {dpo_run}: the run there has training.algorithm 'dpo', this manifest "
        "'sft' (env.objective, env.dataset_path and env.response_column differ too). Resume "
        f"it with the manifest it ran, {dpo_run / 'manifest.yaml'}, or start over with "
        "--overwrite"
    )
    assert _snapshot(dpo_run) == before


def test_a_resume_may_change_what_resumable_changes_lists_and_nothing_else(
    here: Path, tiny_model_dir: Path
) -> None:
    ran = load_manifest(here / SFT_RUN / "manifest.yaml")
    allowed = {"max_steps": 50, "tensorboard": True, "micro_batch_size": 1, "save_every": 5}
    assert manifest_differences(ran, _manifest(tiny_model_dir, "sft_digits.yaml", **allowed)) == []
    relative = _manifest(tiny_model_dir, "sft_digits.yaml")  # the data path, spelled relative
    relative = relative.model_copy(
        update={
            "env": relative.env.model_copy(
                update={
                    "dataset_path": os.path.relpath(
                        ROOT / "manifests" / "data" / "digits_sft.jsonl"
                    )
                }
            )
        }
    )
    assert manifest_differences(ran, relative) == []
    faster = _manifest(tiny_model_dir, "sft_digits.yaml", learning_rate=1e-3)
    assert manifest_differences(ran, faster) == [("training.learning_rate", 3e-4, 1e-3)]
    with pytest.raises(CheckpointError) as raised:
        plan_run(RunSettings.of(faster), resume=True, overwrite=False)
    assert str(raised.value) == (
        "cannot resume runs/digits-sft: the run there has training.learning_rate 0.0003, this "
        "manifest 0.001. Resume it with the manifest it ran, runs/digits-sft/manifest.yaml, "
        "or start over with --overwrite"
    )


def test_resume_without_a_checkpoint_says_why_in_one_line(here: Path, tiny_model_dir: Path) -> None:
    manifest = _manifest(tiny_model_dir, "sft_digits.yaml", output_dir="runs/none")
    with pytest.raises(CheckpointError) as raised:
        train_sft(manifest, resume=True)
    assert str(raised.value) == (
        "no complete checkpoint to resume from in runs/none: no run has started there; train "
        "without --resume to start one"
    )
    shutil.rmtree(here / SFT_RUN / "checkpoint-2")  # a run killed before its first save
    with pytest.raises(CheckpointError) as raised:
        train_sft(_manifest(tiny_model_dir, "sft_digits.yaml"), resume=True)
    assert str(raised.value) == (
        "no complete checkpoint to resume from in runs/digits-sft: the run there stopped "
        "before its first save; start it over with --overwrite"
    )


def test_resume_of_a_complete_run_says_so_and_touches_nothing(
    here: Path, tiny_model_dir: Path
) -> None:
    dump_manifest(_manifest(tiny_model_dir, "sft_digits.yaml", max_steps=2), here / "sft.yaml")
    before = _snapshot(here / SFT_RUN)
    done = _cli("train", "sft.yaml", "--resume", cwd=here)
    assert done.returncode == 0, done.stderr[-3000:]
    loss = _column(here / SFT_RUN, "loss")[2]
    assert done.stdout.splitlines()[-1] == (
        f"runs/digits-sft is already complete at step 2 of 2, mean loss {loss:.4g} over step 2; "
        "nothing was run (raise training.max_steps to train on). No eval config written: its "
        "env is a dataset env (teacher-forced sft rows, no episodes to play); evaluate with one "
        "of yours: agile-llmenvs eval CONFIG.yaml --model runs/digits-sft/checkpoint-2"
    )
    assert _snapshot(here / SFT_RUN) == before


def test_a_resume_further_appends_and_sums_up_what_it_ran(
    here: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = here / "sft.yaml"
    dump_manifest(_manifest(tiny_model_dir, "sft_digits.yaml", max_steps=3), path)
    assert main(["train", str(path), "--resume"]) == 0
    assert _steps(here / SFT_RUN) == [1, 2, 3]
    loss = _column(here / SFT_RUN, "loss")[3]
    last = capsys.readouterr().out.splitlines()[-1]
    assert re.fullmatch(
        rf"trained 3 steps \(1 now, resumed at step 2\) in \d+\.\d s, mean loss "
        rf"{re.escape(f'{loss:.4g}')} over step 3; files in runs/digits-sft\. No eval config "
        rf"written: its env is a dataset env \(teacher-forced sft rows, no episodes to play\); "
        rf"evaluate with one of yours: agile-llmenvs eval CONFIG\.yaml --model "
        rf"runs/digits-sft/checkpoint-3",
        last,
    ), last
    stored = load_manifest(here / SFT_RUN / "manifest.yaml")
    assert stored.training is not None
    assert stored.training.max_steps == 3  # the manifest it ran, now


def test_every_path_is_relative_to_the_manifest_folder_and_the_default_to_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "conf" / "data" / "rows.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    (tmp_path / "conf" / "model").mkdir()
    env = "env: {env_type: dataset, objective: sft, dataset_path: data/rows.jsonl}"
    (tmp_path / "conf" / "set.yaml").write_text(
        f"{env}\nmodel: {{path: model}}\ntraining: {{algorithm: sft, output_dir: out}}\n"
    )
    (tmp_path / "conf" / "unset.yaml").write_text(
        f"name: my run\n{env}\ntraining: {{algorithm: sft}}\n"
    )
    monkeypatch.chdir(tmp_path)
    given = load_manifest("conf/set.yaml")
    assert given.env.dataset_path == str(Path("conf/data/rows.jsonl"))  # type: ignore[union-attr]
    assert given.model.path == str(Path("conf/model"))
    assert RunSettings.of(given).output_dir == Path("conf/out")
    unset = load_manifest("conf/unset.yaml")
    assert RunSettings.of(unset).output_dir == Path("runs/my-run")  # runs/<name> where train runs
    assert RunSettings.of(unset.model_copy(update={"name": None})).output_dir == Path("runs/sft")
    # the README's quick start, from the repository root
    monkeypatch.chdir(ROOT)
    quickstart = load_manifest("manifests/quickstart.yaml")
    assert RunSettings.of(quickstart).output_dir == Path("runs/quickstart")


def test_train_outside_a_terminal_writes_lines_and_ends_with_the_summary(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = {"batch_size": 2, "group_size": 2, "max_new_tokens": 3, "max_steps": 20}
    dump_manifest(_manifest(tiny_model_dir, "quickstart.yaml", **settings), tmp_path / "q.yaml")
    # a fresh datasets cache, so the rows are loaded (and "Generating train split" due) anew
    done = _cli("train", "q.yaml", cwd=tmp_path, HF_DATASETS_CACHE=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\r" not in done.stdout + done.stderr
    for bar in ("Loading weights", "Generating train split", "Writing model shards"):
        assert bar not in done.stderr
    progress = done.stderr.splitlines()
    assert progress[0].startswith("grpo step 1/20: reward ")
    assert re.fullmatch(r"grpo step 20/20: reward \S+, loss \S+ \(\d+ s\)", progress[-1])
    rewards = _column(tmp_path / "runs" / "quickstart", "reward_mean")
    mean = (rewards[19] + rewards[20]) / 2
    last = done.stdout.splitlines()[-1]
    assert re.fullmatch(
        rf"trained 20 steps in \d+\.\d s, mean reward {re.escape(f'{mean:.4g}')} over steps "
        rf"19-20; files in runs/quickstart\. Evaluate with: agile-llmenvs eval "
        rf"runs/quickstart/eval\.yaml",
        last,
    ), last
