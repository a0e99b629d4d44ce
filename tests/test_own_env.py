"""docs/own_env.md shows the files of examples/own_env/ as they are (the env and its
manifest); tests/training/test_eval_config.py trains and evaluates them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "own_env.md"
EXAMPLE = ROOT / "examples" / "own_env"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", GUIDE.read_text(encoding="utf-8"), re.S)


def test_the_guide_shows_the_example_env_and_manifest_as_they_are() -> None:
    assert _blocks("python")[0] == (EXAMPLE / "guess.py").read_text(encoding="utf-8")
    assert _blocks("yaml")[0] == (EXAMPLE / "guess.yaml").read_text(encoding="utf-8")


def test_the_guide_is_linked_from_the_readme_the_index_and_the_site() -> None:
    for page in ("README.md", "docs/index.md"):
        assert "own_env.md" in (ROOT / page).read_text(encoding="utf-8"), page
    assert "own_env.md" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
