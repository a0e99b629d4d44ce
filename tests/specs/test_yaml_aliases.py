"""YAML aliases are bounded at load: an alias bomb is refused, ordinary aliases still load."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agile_llmenvs._imports import load_env_config
from agile_llmenvs.cli import main
from agile_llmenvs.config import EvalConfig
from agile_llmenvs.errors import EnvBuildError, ManifestError
from agile_llmenvs.specs import LLMEnvSpec, dump_manifest, load_manifest

#: Nine levels of nine aliases each: 9**9 strings once expanded, in a 428-byte manifest that
#: validates (``env_config`` takes anything) and then hangs whatever walks it.
BOMB = (
    "name: bomb\n"
    "env:\n"
    "  env_type: rollout\n"
    "  entrypoint: a:B\n"
    "  env_config:\n"
    '    a: &a ["x","x","x","x","x","x","x","x","x"]\n'
    + "".join(
        f"    {b}: &{b} [{','.join([f'*{a}'] * 9)}]\n"
        for a, b in zip("abcdefgh", "bcdefghi", strict=True)
    )
)


def _bomb_adds() -> int:
    """Nodes the bomb's aliases add: lists ``a`` .. ``i`` expand to 10, 91, 820, ... nodes,
    and as written they are 18 (``a`` and its nine strings, then one list each)."""
    sizes = [10]
    while len(sizes) < 9:
        sizes.append(1 + 9 * sizes[-1])
    return sum(sizes) - 18


BOMB_ADDS = _bomb_adds()
#: What ``load_manifest``'s message says after ``not valid YAML: ``.
REFUSAL = (
    f"its aliases expand it by {BOMB_ADDS} nodes, more than the limit of 10000 (a YAML alias "
    "bomb?); write the repeated values out, or repeat them fewer times"
)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_an_alias_bomb_manifest_is_refused_quickly(tmp_path: Path) -> None:
    path = _write(tmp_path, "bomb.yaml", BOMB)
    assert len(BOMB.encode()) == 428
    start = time.perf_counter()
    with pytest.raises(ManifestError) as raised:
        load_manifest(path)
    assert time.perf_counter() - start < 0.5
    assert str(raised.value) == f"{path}: not valid YAML: {REFUSAL}"


def test_validate_reports_an_alias_bomb(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "bomb.yaml", BOMB)
    assert main(["validate", str(path)]) == 2  # a user's mistake: one line, exit 2
    assert capsys.readouterr().err == f"error {path}: not valid YAML: {REFUSAL}\n"


def test_eval_configs_and_env_config_files_refuse_an_alias_bomb(tmp_path: Path) -> None:
    body = BOMB.split("  env_config:\n", 1)[1].replace("    ", "", -1)
    path = _write(tmp_path, "bomb.yaml", body)
    with pytest.raises(ManifestError) as raised:
        EvalConfig.from_yaml(path)
    assert str(raised.value) == f"{path} is not valid YAML: {REFUSAL}"
    with pytest.raises(EnvBuildError) as built:
        load_env_config(str(path))
    assert str(built.value) == f"env_config: {str(path)!r} is not valid YAML/JSON: {REFUSAL}"


def test_a_recursive_alias_is_refused(tmp_path: Path) -> None:
    text = "env:\n  env_type: rollout\n  entrypoint: a:B\n  env_config: {loop: &l [*l]}\n"
    path = _write(tmp_path, "loop.yaml", text)
    with pytest.raises(ManifestError) as raised:
        load_manifest(path)
    assert str(raised.value) == (
        f"{path}: not valid YAML: an alias refers to a node from inside that node (a recursive "
        "document); write the value out"
    )


def test_ordinary_aliases_still_load_and_round_trip(tmp_path: Path) -> None:
    text = (
        "env:\n"
        "  env_type: rollout\n"
        "  entrypoint: a:B\n"
        "  env_config:\n"
        "    defaults: &defaults {size: 3, words: [a, b, c]}\n"
        "    easy: {<<: *defaults, level: 1}\n"
        "    hard: {<<: *defaults, level: 2}\n"
        "    words_again: &w [x, y]\n"
        "    and_again: *w\n"
    )
    manifest = load_manifest(_write(tmp_path, "ok.yaml", text))
    assert isinstance(manifest.env, LLMEnvSpec)
    config = manifest.env.env_config
    assert isinstance(config, dict)
    assert config["easy"] == {"size": 3, "words": ["a", "b", "c"], "level": 1}
    assert config["hard"]["level"] == 2
    assert config["and_again"] == ["x", "y"]
    dump_manifest(manifest, tmp_path / "back.yaml")
    assert load_manifest(tmp_path / "back.yaml") == manifest
