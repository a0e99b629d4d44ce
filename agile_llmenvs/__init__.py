"""agile_llmenvs: the environment layer of LLM reinforcement learning.

Import from the sub-packages (``agile_llmenvs.specs``, ``agile_llmenvs.envs``, ...); this top
level stays light so the command line starts fast.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
