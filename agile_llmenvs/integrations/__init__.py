"""Adapters that let other trainers train on our envs, one module per trainer.

* :mod:`agile_llmenvs.integrations.trl` — TRL's ``GRPOTrainer`` (``pip install -e ".[trl]"``).

Each module imports its trainer lazily, so this package imports without any of them.
"""

from __future__ import annotations

__all__: list[str] = []
