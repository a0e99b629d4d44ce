"""MkDocs hook: render the Sphinx roles of the package's docstrings as plain code.

Docstrings write ``:class:`Name``` (the Sphinx form); Markdown renders that as the role name
followed by the code. This keeps the code and drops the role; ``~a.b.Name`` shows ``Name``,
as Sphinx does.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|const):<code>(~?)([^<]*)</code>")


def _plain(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"<code>{target.rsplit('.', 1)[-1] if short else target}</code>"


def on_page_content(html: str, **_: Any) -> str:
    """Strip Sphinx roles from a page's rendered HTML."""
    return _ROLE.sub(_plain, html)
