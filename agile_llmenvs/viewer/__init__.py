"""Looking at rollouts: a run's logged episodes as one self-contained HTML page.

The GRPO trainer logs a few episodes every ``training.log_rollouts_every`` steps to
``output_dir/rollouts.jsonl`` (:mod:`agile_llmenvs.training.run.rollout_log`);
``agile-llmenvs show RUN`` (or :func:`write_page`) turns them, with the run's ``metrics.csv``,
into ``RUN/rollouts.html``: transcripts coloured by provenance, per-turn rewards, stop reasons
and the reward curve. The page needs no server, script or network. Nothing here imports torch.
"""

from __future__ import annotations

from agile_llmenvs.viewer.command import write_page
from agile_llmenvs.viewer.page import RunPage, render_page
from agile_llmenvs.viewer.records import (
    EpisodeRecord,
    RolloutLogError,
    read_reward_curve,
    read_rollouts,
)

__all__ = [
    "EpisodeRecord",
    "RolloutLogError",
    "RunPage",
    "read_reward_curve",
    "read_rollouts",
    "render_page",
    "write_page",
]
