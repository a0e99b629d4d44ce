"""``agile-llmenvs --help`` and each command's ``--help`` import no heavy library.

Asserted on ``sys.modules`` of a fresh interpreter rather than on a time, which flakes under
load: torch and transformers alone take seconds to import.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "datasets", "accelerate", "numpy", "uvicorn", "openenv")

_SCRIPT = """
import contextlib, io, json, sys
from agile_llmenvs.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
heavy = sorted({name.split(".")[0] for name in sys.modules} & set(json.loads(sys.stdin.read())))
print(json.dumps({"heavy": heavy, "help": out.getvalue()}))
"""


@pytest.mark.parametrize(
    "argv",
    [[], ["train"], ["eval"], ["serve"], ["show"], ["bench"], ["validate"], ["schema"]],
    ids=lambda argv: " ".join(argv) or "top",
)
def test_help_imports_no_heavy_library(argv: list[str]) -> None:
    completed = subprocess.run(
        [sys.executable, "-c", _SCRIPT, *argv, "--help"],
        input=json.dumps(HEAVY),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(completed.stdout.splitlines()[-1])
    assert result["heavy"] == []
    assert result["help"].startswith("usage: agile-llmenvs")


def test_serve_help_shows_the_defaults() -> None:
    from agile_llmenvs.cli import _parser

    serve = _parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    helps = {action.dest: action.help for action in serve._actions}
    assert "default: 127.0.0.1" in str(helps["host"])
    assert "default: 8000" in str(helps["port"])
