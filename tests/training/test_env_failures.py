"""Env failures that speak (#33): a bug in an env is printed once with its file and line, a
run whose env keeps failing stops with exit 2, and a setup mistake leaves nothing behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agile_llmenvs.cli import main
from agile_llmenvs.core import EpisodeData, StopReason, Trajectory, failed_episode
from agile_llmenvs.errors import EnvFailuresError
from agile_llmenvs.llm_envs.tasks import Task
from agile_llmenvs.training.run import EnvFailures, failure_kind

# A two-turn env with a bug on its second turn: `undefined_name` is a NameError.
BUGGY_ENV = """\
class GuessEnv:
    def __init__(self, size: int = 3):
        self.size = size

    def reset(self, *, seed=None, **task):
        self.turn = 0
        return "Guess a digit.", {}

    def step(self, action):
        self.turn += 1
        if self.turn >= 2:
            return undefined_name, 1.0, True, False, {}
        return "again", 0.0, False, False, {}

    def close(self):
        pass
"""


def _manifest(
    folder: Path, model: Path, *, env_config: str = "{size: 3}", **training: object
) -> Path:
    """A GRPO manifest of ``folder/guess_env.py`` (written), 2 groups of 4, 3 turns."""
    (folder / "guess_env.py").write_text(BUGGY_ENV)
    extra = "".join(f"  {key}: {value}\n" for key, value in training.items())
    path = folder / "guess.yaml"
    path.write_text(
        "name: guess\n"
        "env:\n"
        "  env_type: rollout\n"
        f"  entrypoint: {folder / 'guess_env.py'}:GuessEnv\n"
        f"  env_config: {env_config}\n"
        "  max_turns: 3\n"
        f"model: {{path: {model}}}\n"
        "training:\n"
        "  algorithm: grpo\n"
        "  batch_size: 2\n"
        "  group_size: 4\n"
        "  max_new_tokens: 4\n"
        f"  output_dir: {folder / 'run'}\n" + extra
    )
    return path


def _the_bug_line() -> int:
    """The 1-based line of ``undefined_name`` in BUGGY_ENV, counted from the text."""
    return next(n for n, line in enumerate(BUGGY_ENV.splitlines(), 1) if "undefined_name" in line)


def test_a_bug_in_the_env_is_printed_once_and_the_run_stops_at_the_threshold(
    tmp_path: Path,
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # the env's file is named relative to the working folder
    path = _manifest(tmp_path, tiny_model_dir, max_steps=6, max_failed_steps=2)
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    where = f"guess_env.py:{_the_bug_line()} in step"
    reports = [line for line in err.splitlines() if line.startswith("env error at step")]
    assert reports == [
        "env error at step 1 (8 of 8 episodes; first of its kind, later ones are counted in "
        "failed_episodes): EnvExecutionError: in-process env: NameError: name "
        f"'undefined_name' is not defined (raised as NameError at {where}) "
        "[code EXECUTION_ERROR]"
    ]
    stop = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(stop) == 1
    assert stop[0].startswith(
        "error: the env failed in more than 25% of the episodes for 2 steps in a row (step 2: "
        "8 of 8): stopping, as training.max_failed_fraction and training.max_failed_steps say; "
        "the first error: EnvExecutionError: in-process env: NameError: name 'undefined_name' "
        f"is not defined (raised as NameError at {where})"
    )
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[1:]
    assert [row.split(",")[0] for row in rows] == ["1", "2"]  # stopped at the second step
    logged = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").open()]
    # log_rollouts_every is 10: every logged episode is there because it failed
    assert [(r["step"], r["stop_reason"]) for r in logged] == [(1, "env_error")] * 8 + [
        (2, "env_error")
    ] * 8
    assert all(where in r["error"] for r in logged)
    assert all(r["failed"] is True for r in logged)  # a failure, not a reward of 0
    # no checkpoint was saved (save_every is 100): --resume would refuse, so it is not offered
    assert stop[0].endswith(
        "fix the env and train again (no checkpoint was saved: --overwrite starts over) "
        "(--debug shows the traceback)"
    )


def test_the_stop_offers_resume_only_once_a_checkpoint_exists(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _manifest(tmp_path, tiny_model_dir, max_steps=6, max_failed_steps=2, save_every=1)
    assert main(["train", str(path)]) == 2
    stop = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert stop[0].endswith(
        "fix the env and train again (--resume continues from the last checkpoint, "
        "--overwrite starts over) (--debug shows the traceback)"
    )
    assert (tmp_path / "run" / "checkpoint-1").is_dir()


def test_a_run_told_never_to_stop_trains_on_and_reports_each_kind_once(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _manifest(tmp_path, tiny_model_dir, max_steps=3, max_failed_fraction=1.0)
    assert main(["train", str(path)]) == 0
    captured = capsys.readouterr()
    assert next(line for line in captured.err.splitlines() if "env error" in line).startswith(
        "env error at step 1 (8 of 8 episodes"
    )
    assert captured.err.count("env error") == 1
    assert "failed 8/8" in captured.err  # the progress line's count, as the stop message's
    assert "trained 3 steps" in captured.out


def test_a_wrong_env_config_key_is_one_line_exit_2_and_the_folder_stays_reusable(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _manifest(tmp_path, tiny_model_dir, env_config="{sizes: 3}", max_steps=1)
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("error: env.env_config: 'sizes'")
    assert not (tmp_path / "run").exists()  # the run made the folder: it is gone again
    # a folder that was there keeps what it held, and nothing of the failed run
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    assert main(["train", str(path)]) == 2
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["notes.txt"]
    capsys.readouterr()
    fixed = _manifest(tmp_path, tiny_model_dir, max_steps=1, max_failed_fraction=1.0)
    assert main(["train", str(fixed)]) == 0  # a plain re-run: no --overwrite needed
    assert "trained 1 step" in capsys.readouterr().out


def _trajectory(episode: EpisodeData) -> Trajectory:
    return Trajectory(0, 0, Task(seed=0), episode)


def _finished() -> Trajectory:
    return _trajectory(EpisodeData((), (1.0,), StopReason.TERMINATED, {}))


ERROR = "EnvExecutionError: x: KeyError: 'a' (raised as KeyError at env.py:7 in step) [code E]"


def test_a_failing_step_is_above_the_fraction_and_the_streak_must_be_unbroken() -> None:
    failures = EnvFailures(0.25, 2, report=False)
    failures.check(1, 1, 4)  # exactly 25%: not above it
    failures.check(2, 2, 4)  # failing, 1 in a row
    failures.check(3, 0, 4)  # the streak breaks
    failures.check(4, 2, 4)
    with pytest.raises(EnvFailuresError, match=r"for 2 steps in a row \(step 5: 3 of 4\)"):
        failures.check(5, 3, 4)


def test_kinds_are_the_exception_and_its_place_and_each_is_reported_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    other_key = ERROR.replace("'a'", "'b'")  # the same bug, another value: the same kind
    assert failure_kind(ERROR) == failure_kind(other_key) == "KeyError at env.py:7 in step"
    assert failure_kind("the env call exceeded io_timeout_s=5") == (
        "the env call exceeded io_timeout_s=5"
    )
    failures = EnvFailures(0.5, 3)
    batch = [
        _trajectory(failed_episode(ERROR)),
        _finished(),
        _trajectory(failed_episode(other_key)),
    ]
    failures.see(1, batch)
    failures.see(2, [_trajectory(failed_episode("timed out"))])
    assert capsys.readouterr().err.splitlines() == [
        "env error at step 1 (2 of 3 episodes; first of its kind, later ones are counted in "
        f"failed_episodes): {ERROR}",
        "env error at step 2 (1 of 1 episodes; first of its kind, later ones are counted in "
        "failed_episodes): timed out",
    ]
