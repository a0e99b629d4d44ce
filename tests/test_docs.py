"""Every code block in docs/ and README.md is run or checked, so the docs cannot drift.

* ``python`` blocks run. Blocks of one page run in order in one namespace, as a reader would
  run them.
* ``bash`` blocks are checked command by command: ``agile-llmenvs`` (and ``-m agile_llmenvs``)
  commands must parse with the real argument parser and name manifests that exist,
  ``python X.py`` and ``pytest`` paths must exist, and ``pip install -e ".[a,b]"`` extras must
  be declared in pyproject.toml. (Installs, venvs and long runs are not executed here; CI runs
  the README's commands itself.)
* ``yaml`` blocks must parse; a run manifest (an ``env`` key) or an eval config (an
  ``environments`` key) must validate.
* ``text`` blocks are output shown to the reader and are not checked.

A block preceded by ``<!-- no-test: reason -->`` (one needing a GPU, a paid API, or showing
another library's code) is skipped; a page with ``<!-- requires: module -->`` runs its python
blocks only where that optional module is installed.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
IDS = [str(p.relative_to(ROOT)) for p in PAGES]
FENCE = re.compile(r"(<!-- no-test[^>]*-->\s*)?```(\w*)\n(.*?)```", re.S)
SHELL = {"bash", "sh", "shell", "console"}
KNOWN = {"python", "yaml", "text", *SHELL}
OUTPUT_FLAGS = {"-o", "--output"}


def _blocks(page: Path, language: str | set[str]) -> list[str]:
    """The unmarked blocks of ``page`` in ``language``, in page order."""
    wanted = {language} if isinstance(language, str) else language
    text = page.read_text(encoding="utf-8")
    return [code for skip, lang, code in FENCE.findall(text) if lang in wanted and not skip]


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_python_blocks_run(page: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    text = page.read_text(encoding="utf-8")
    for module in re.findall(r"<!-- requires: ([\w.]+) -->", text):
        pytest.importorskip(module, reason=f"{page.name} needs {module}")
    monkeypatch.chdir(_reader_folder(tmp_path))
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for code in _blocks(page, "python"):
        exec(compile(code, str(page), "exec"), namespace)


def _reader_folder(tmp_path: Path) -> Path:
    """A folder that reads as the repository (its files, linked) but keeps what the blocks
    write (``runs/``, say) out of it."""
    for entry in ROOT.iterdir():
        if not entry.name.startswith(".") and entry.name not in {"runs", "site"}:
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_block_has_a_checked_language(page: Path) -> None:
    languages = [lang for _, lang, _ in FENCE.findall(page.read_text(encoding="utf-8"))]
    unknown = sorted({lang or "(none)" for lang in languages} - KNOWN)
    assert not unknown, (
        f"{page.name}: code blocks in {unknown} are neither run nor checked; use one of "
        f"{sorted(KNOWN)}, or mark the block <!-- no-test: reason -->"
    )


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_shell_blocks_name_real_commands_and_files(page: Path) -> None:
    for script in _blocks(page, SHELL):
        for words in _commands(script):
            _check_command(words, page)


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_yaml_blocks_validate(page: Path) -> None:
    from agile_llmenvs.config import EvalConfig
    from agile_llmenvs.specs import RunManifest

    for code in _blocks(page, "yaml"):
        data = yaml.safe_load(code)
        if isinstance(data, dict) and "env" in data:
            RunManifest.model_validate(data)
        elif isinstance(data, dict) and "environments" in data:
            EvalConfig.model_validate(data)


def test_getting_started_starts_with_the_readme_commands() -> None:
    readme = _blocks(ROOT / "README.md", "bash")[:2]
    index = _blocks(ROOT / "docs" / "index.md", "bash")[:2]
    assert len(readme) == 2
    assert index == readme


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (
            "agile-llmenvs train manifests/quickstart.yaml --no-such-option",
            "index.md: `agile-llmenvs train manifests/quickstart.yaml --no-such-option`: "
            "the command line does not parse",
        ),
        (
            "agile-llmenvs validate manifests/absent.yaml",
            "index.md: `agile-llmenvs validate manifests/absent.yaml`: "
            "no manifest manifests/absent.yaml",
        ),
        (
            'pip install -e ".[dev,nonexistent]"',
            "index.md: `pip install -e .[dev,nonexistent]`: extras ['nonexistent'] undeclared",
        ),
        ("python bench/absent.py", "index.md: `python bench/absent.py`: no file bench/absent.py"),
        (
            "HF_HUB_OFFLINE=1 pytest -m vllm tests/absent_test.py::test_x",
            "index.md: `pytest -m vllm tests/absent_test.py::test_x`: "
            "no test path tests/absent_test.py",
        ),
    ],
)
def test_shell_checks_catch_drift(command: str, message: str) -> None:
    [words] = _commands(command)
    with pytest.raises(AssertionError) as caught:
        _check_command(words, ROOT / "docs" / "index.md")
    assert str(caught.value).splitlines()[0] == message


def _commands(script: str) -> list[list[str]]:
    """Each simple command of a shell block, as words, without leading ``VAR=value``s."""
    commands = []
    for line in script.replace("\\\n", " ").splitlines():
        line = line.strip().removeprefix("$ ")
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"\s*(?:&&|\|\||;)\s*", line):
            words = shlex.split(part, comments=True)
            while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
                words.pop(0)
            if words:
                commands.append(words)
    return commands


def _check_command(words: list[str], page: Path) -> None:
    where = f"{page.name}: `{' '.join(words)}`"
    if words[0] == "agile-llmenvs":
        _check_cli(words[1:], where)
    elif "-m" in words and words[words.index("-m") + 1 :][:1] == ["agile_llmenvs"]:
        _check_cli(words[words.index("-m") + 2 :], where)
    elif words[0] in ("python", "python3") and words[1:2] and words[1].endswith(".py"):
        assert (ROOT / words[1]).is_file(), f"{where}: no file {words[1]}"
    elif words[:2] == ["pip", "install"]:
        _check_extras(words[2:], where)
    elif words[0] == "pytest":
        _check_test_paths(words[1:], where)


def _check_cli(args: list[str], where: str) -> None:
    from agile_llmenvs.cli import _parser

    try:
        _parser().parse_args(args)
    except SystemExit as exc:
        raise AssertionError(f"{where}: the command line does not parse") from exc
    for previous, word in zip(["", *args], args, strict=False):
        if word.endswith((".yaml", ".yml")) and previous not in OUTPUT_FLAGS:
            assert (ROOT / word).is_file(), f"{where}: no manifest {word}"


def _check_extras(args: list[str], where: str) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = set(project["optional-dependencies"])
    for arg in args:
        match = re.fullmatch(r"\.\[([\w,-]+)\]", arg)
        if match:
            extras = set(match.group(1).split(","))
            assert extras <= declared, f"{where}: extras {sorted(extras - declared)} undeclared"


def _check_test_paths(args: list[str], where: str) -> None:
    takes_value = {"-m", "-k", "-p", "--timeout", "-n", "--dist", "--durations"}
    for previous, word in zip(["", *args], args, strict=False):
        if word.startswith("-") or previous in takes_value:
            continue
        path = word.split("::")[0]
        assert (ROOT / path).exists(), f"{where}: no test path {path}"
