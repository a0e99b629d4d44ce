"""The documentation site builds in strict mode: no broken link, nav entry or reference."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("mkdocs", reason="the site needs the docs extra")
pytest.importorskip("material", reason="the site needs the docs extra")
pytest.importorskip("mkdocstrings_handlers.python", reason="the site needs the docs extra")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once with ``mkdocs build --strict`` into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-4000:]}"
    return out


def _text(page: Path) -> str:
    """The visible text of a built page, tags dropped and whitespace collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page.read_text())).split())


def test_every_nav_page_is_built(site: Path) -> None:
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(nav: list[object]) -> list[str]:
        found: list[str] = []
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            found += pages(value) if isinstance(value, list) else [str(value)]
        return found

    for source in pages(config["nav"]):
        built = "index.html" if source == "index.md" else source.removesuffix(".md") + "/index.html"
        assert (site / built).is_file(), f"{source} was not built"


def test_api_pages_render_docstrings(site: Path) -> None:
    specs = _text(site / "api" / "specs" / "index.html")
    assert "Read a run manifest from a .yaml / .yml or .json file." in specs
    training = _text(site / "api" / "training" / "index.html")
    assert "What a training run leaves behind." in training
    assert "The value of key at the last step run now." in training
    branching = _text(site / "api" / "branching" / "index.html")
    assert "BranchManager checkpoints states by name" in branching
    # the docs hook renders Sphinx roles (:class:`X`) as plain code
    assert ":class:" not in branching
    assert ":meth:" not in _text(site / "api" / "llm_envs" / "index.html")


def test_performance_page_includes_the_generated_table(site: Path) -> None:
    table = (ROOT / "docs" / "performance_table.md").read_text()
    last_line = table.strip().splitlines()[-1]  # "Targets met: N of M."
    page = _text(site / "performance" / "index.html")
    assert last_line in page
    assert "script figure value target met?" in page
