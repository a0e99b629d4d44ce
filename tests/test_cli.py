"""The `agile-llmenvs` command line: validate and schema, in-process and as a real process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agile_llmenvs.cli import main
from agile_llmenvs.specs import manifest_json_schema

MANIFESTS = Path(__file__).resolve().parents[1] / "manifests"


def test_validate_ok(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["validate", str(MANIFESTS / "cartpole.yaml"), str(MANIFESTS / "rollout_digits.yaml")])
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"ok    {MANIFESTS / 'cartpole.yaml'}: run 'cartpole': gym env 'CartPole-v1' x4",
        f"ok    {MANIFESTS / 'rollout_digits.yaml'}: run 'digits': rollout env "
        f"'{MANIFESTS / 'data' / 'digits.jsonl'}' from dataset, trained with grpo",
    ]


def test_validate_reports_every_problem_by_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("env: {env_type: rollout, objective: sft, entrypoint: 'a:B', max_turns: 0}\n")
    assert main(["validate", str(bad), str(MANIFESTS / "cartpole.yaml")]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"error {bad}: run manifest, 1 problem(s)",
        "  env.max_turns: Input should be greater than or equal to 1",
    ]
    assert captured.out.startswith("ok    ")


def test_validate_reports_unreadable_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", str(tmp_path / "absent.yaml")]) == 2
    assert capsys.readouterr().err == (
        f"error {tmp_path / 'absent.yaml'}: cannot read it: No such file or directory\n"
    )


def test_schema_to_stdout_and_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == manifest_json_schema()
    target = tmp_path / "schema.json"
    assert main(["schema", "-o", str(target)]) == 0
    assert json.loads(target.read_text()) == manifest_json_schema()


def test_console_script_and_module_run_as_processes() -> None:
    script = shutil.which("agile-llmenvs")
    commands = [[sys.executable, "-m", "agile_llmenvs"]]
    if script is not None:
        commands.append([script])
    for command in commands:
        done = subprocess.run(
            [*command, "validate", str(MANIFESTS / "sft_digits.yaml")],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "dataset env" in done.stdout
        done = subprocess.run(
            [*command, "bogus"], capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 2
        assert "invalid choice: 'bogus'" in done.stderr


def test_a_users_mistake_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "echo_envs:EchoEnv", "--port", "0", "--token", ""]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: ValueError: token is empty: an empty token would accept every client; pass a "
        "secret, or token=None to serve without authentication (--debug shows the traceback)\n"
    )


def test_debug_shows_the_traceback_before_or_after_the_command() -> None:
    for argv in (
        ["--debug", "serve", "echo_envs:EchoEnv", "--port", "0", "--token", ""],
        ["serve", "echo_envs:EchoEnv", "--port", "0", "--token", "", "--debug"],
    ):
        with pytest.raises(ValueError, match="token is empty"):
            main(argv)
