"""``agile-llmenvs eval``: progress bar, results table, JSON output, config errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from fakes import ChatAPIServer

from agile_llmenvs.evaluation.command import register


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agile-llmenvs")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.run(args))


CONFIG = """\
environments:
  - {{name: even, source: entry_point, entry_point: "fakes:DigitEnv", size: 4}}
  - {{name: short, source: entry_point, entry_point: "fakes:DigitEnv", size: 2}}
model: {{backend: openai, model: m, base_url: "{url}"}}
inference: {{temperature: 0.0, max_tokens: 4}}
system_prompt: Answer with the digit.
"""


def test_eval_prints_a_table_and_writes_json(
    tmp_path: Path, server: ChatAPIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # Right for rows 0 and 1 only.
    server.reply = lambda messages: {"0": "0", "1": "1"}.get(messages[-1]["content"][-2], "9")
    config = tmp_path / "eval.yaml"
    config.write_text(CONFIG.format(url=server.openai_url), encoding="utf-8")
    output = tmp_path / "out" / "results.json"
    assert run(["eval", str(config), "--output", str(output), "--batch-size", "3"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "environment  tasks  accuracy  mean reward  mean steps  errors",
        "-----------  -----  --------  -----------  ----------  ------",
        "even             4     50.0%        0.500        1.00       0",
        "short            2    100.0%        1.000        1.00       0",
        "overall          6     66.7%        0.667        1.00       0",
        f"wrote {output}",
    ]
    assert "eval: 100%" in err
    assert "6/6" in err
    assert len(server.requests) == 6
    report = json.loads(output.read_text(encoding="utf-8"))
    assert report["overall"]["success_rate"] == pytest.approx(4 / 6)
    assert [e["env_name"] for e in report["environments"]] == ["even", "short"]
    assert report["environments"][0]["trajectories"][2]["actions"] == ["9"]
    assert report["config"]["system_prompt"] == "Answer with the digit."


def test_eval_names_the_bad_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("environments: [{name: a}]\nmodel: {backend: openai}\n", encoding="utf-8")
    assert run(["eval", str(config)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error {config}: 1 problem(s)",
        "  model.model: Field required",
    ]
    assert run(["eval", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read eval config" in capsys.readouterr().err


def test_eval_reports_setup_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    config = tmp_path / "eval.yaml"
    config.write_text(
        'environments: [{name: d, source: entry_point, entry_point: "fakes:DigitEnv"}]\n'
        "model: {backend: anthropic, model: claude}\n",
        encoding="utf-8",
    )
    assert run(["eval", str(config)]) == 2
    assert capsys.readouterr().err == (
        "error: AnthropicBackend needs an API key: pass api_key=... or set ANTHROPIC_API_KEY.\n"
    )
