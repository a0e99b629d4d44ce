"""A few of a run's episodes, token-exact, to look at: ``output_dir/rollouts.jsonl``.

Every ``log_rollouts_every`` steps the GRPO trainer's main process appends the first
``log_rollouts_count`` episodes of its batch, and at every step each episode whose env failed
(so a broken env's episodes are there to look at, whatever the settings), one JSON object a
line::

    {"step": 10, "group": 0, "slot": 0, "task": {"seed": 7, "row_index": 3},
     "reward": 1.0, "rewards": [1.0], "stop_reason": "terminated", "failed": false,
     "samples": [{"token_ids": [...], "provenance": "ppppssse", "turn_ids": [...],
                  "spans": [{"source": "prompt", "turn": -1, "text": "..."}, ...]}]}

``samples`` holds the episode's token samples (one, unless its context was restarted).
``token_ids`` are the sample's own ids; ``provenance`` has one character per id, aligned with
them: ``p`` prompt (before the first sampled id), ``s`` sampled by the policy, ``e`` inserted
by the env or the chat template after it. ``turn_ids`` is aligned the same way: the turn of a
sampled id, else -1 (the sample's ``turn_ids`` describe next-token targets, so they are this
list without its first entry). ``spans`` are runs of one source and turn, decoded for display
only; training never reads them. A failed episode says ``"failed": true`` (its ``reward`` is
no score: the group's advantages leave it out), and has an ``error`` and no samples.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from agile_llmenvs.core import TokenSample, Trajectory

__all__ = [
    "ENV",
    "PROMPT",
    "SAMPLED",
    "RolloutLog",
    "episode_record",
    "provenance",
]


#: Provenance characters: a prompt id, an id the policy sampled, an id the env inserted.
PROMPT, SAMPLED, ENV = "p", "s", "e"
_SOURCES = {PROMPT: "prompt", SAMPLED: "sampled", ENV: "env"}


class RolloutLog:
    """Appends the first ``count`` episodes of every ``every``-th step to ``path``, and the
    failed episodes of every step.

    Args:
        path: The JSON-lines file.
        tokenizer: The policy's tokenizer, to decode the spans.
        every: Steps between logged batches (0: none; failed episodes are still logged).
        count: Episodes logged per logged step.
        resume_step: The step a resumed run continues from: lines up to it are kept, later
            ones (a run that went on past its last checkpoint) dropped. ``None`` starts over.
    """

    def __init__(
        self,
        path: Path,
        tokenizer: Any,
        *,
        every: int,
        count: int,
        resume_step: int | None = None,
    ) -> None:
        self.path, self.tokenizer, self.every, self.count = path, tokenizer, every, count
        if resume_step is None:
            path.unlink(missing_ok=True)  # a previous run's episodes would pass for this one's
        elif path.exists():
            _drop_lines_after(path, resume_step)

    def due(self, step: int) -> bool:
        """Whether ``step`` (1-based) is one whose episodes are logged."""
        return self.every > 0 and step % self.every == 0

    def maybe_write(self, step: int, trajectories: Sequence[Trajectory]) -> None:
        """Append the first ``count`` of ``trajectories`` when ``step`` is due, then the
        failed ones among the rest (all of them when it is not), in batch order."""
        shown = self.count if self.due(step) else 0
        logged = [t for i, t in enumerate(trajectories) if i < shown or t.failed]
        if not logged:
            return
        lines = [
            json.dumps(
                episode_record(step, t, self.tokenizer), separators=(",", ":"), ensure_ascii=False
            )
            for t in logged
        ]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as file:
            file.write("".join(line + "\n" for line in lines))  # one write: one step's lines


def episode_record(step: int, trajectory: Trajectory, tokenizer: Any) -> dict[str, Any]:
    """The JSON object of one logged episode (the module docstring lists its fields)."""
    episode = trajectory.episode
    record: dict[str, Any] = {
        "step": step,
        "group": trajectory.group,
        "slot": trajectory.slot,
        "task": {"seed": trajectory.task.seed, "row_index": trajectory.task.row_index},
        "reward": episode.total_reward,
        "rewards": list(episode.rewards),
        "stop_reason": str(episode.stop_reason),
        "failed": trajectory.failed,
        "samples": [_sample_record(sample, tokenizer) for sample in episode.samples],
    }
    if "error" in episode.info:
        record["error"] = str(episode.info["error"])
    return record


def provenance(sample: TokenSample) -> str:
    """One provenance character per id of ``sample`` (see the module docstring)."""
    chars = [PROMPT]
    seen_sampled = False
    for sampled in sample.action_mask:
        seen_sampled = seen_sampled or sampled
        chars.append(SAMPLED if sampled else ENV if seen_sampled else PROMPT)
    return "".join(chars)


def _sample_record(sample: TokenSample, tokenizer: Any) -> dict[str, Any]:
    sources = provenance(sample)
    turn_ids = [-1, *sample.turn_ids]
    return {
        "token_ids": list(sample.token_ids),
        "provenance": sources,
        "turn_ids": turn_ids,
        "spans": [
            {"source": _SOURCES[source], "turn": turn, "text": _decode(tokenizer, ids)}
            for source, turn, ids in _spans(sample.token_ids, sources, turn_ids)
        ],
    }


def _spans(
    token_ids: Sequence[int], sources: str, turn_ids: Sequence[int]
) -> Iterable[tuple[str, int, list[int]]]:
    """Runs of consecutive ids of one source and turn."""
    start = 0
    for end in range(1, len(token_ids) + 1):
        at_end = end == len(token_ids)
        if at_end or (sources[end], turn_ids[end]) != (sources[start], turn_ids[start]):
            yield sources[start], turn_ids[start], list(token_ids[start:end])
            start = end


def _decode(tokenizer: Any, ids: list[int]) -> str:
    # Special tokens stay visible: the chat template's markers are part of what the policy saw.
    return str(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


def _drop_lines_after(path: Path, step: int) -> None:
    """Keep the lines of steps up to ``step``; a line cut short by a kill goes too."""
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("step", step + 1) <= step:
            kept.append(line + "\n")
    path.write_text("".join(kept), encoding="utf-8")
