"""Every ``python`` code block in docs/ and README.md runs, so the docs cannot drift from the code.

A block preceded by ``<!-- no-test: reason -->`` (one needing a GPU or a paid API) is skipped;
a page with ``<!-- requires: module -->`` is skipped where that optional module is missing.
Blocks of one page run in order in one namespace, as a reader would run them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
BLOCK = re.compile(r"(<!-- no-test[^>]*-->\s*)?```python\n(.*?)```", re.S)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_python_blocks_run(page: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = page.read_text(encoding="utf-8")
    for module in re.findall(r"<!-- requires: ([\w.]+) -->", text):
        pytest.importorskip(module, reason=f"{page.name} needs {module}")
    monkeypatch.chdir(ROOT)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for skip, code in BLOCK.findall(text):
        if not skip:
            exec(compile(code, str(page), "exec"), namespace)
