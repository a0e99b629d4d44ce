"""One module per external env source, each turning that source into text envs.

Import the module you need (``agile_llmenvs.adapters.reasoning_gym``, ``.gem``, ...): each
imports its optional package lazily and says which extra to install when it is missing.
"""

from __future__ import annotations

__all__: list[str] = []
