"""How many intra-op threads torch runs a CPU training run's maths on.

A small model's matrices are too small to split: torch's threads on the built-in tiny model
(hidden size 64) spend their time waiting for each other. On 2 idle cores one thread ran the
quick start in 0.98-1.23x the time of torch's default two, but beside two busy processes, where
a thread waiting for a core another process holds stalls every operation, in 0.41-0.49x, and
with 0.28-0.35x the CPU (``bench/quickstart_threads.py``, two runs). So a run on CPU whose
policy holds fewer than :data:`SMALL_MODEL_PARAMETERS` parameters runs on one thread; a larger
one keeps torch's default. A choice made elsewhere wins, in this order: the manifest's
``training.cpu_threads``, then ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` in the environment,
then a ``torch.set_num_threads`` call that changed the count torch had when this module was
imported. On a GPU the count is left alone.
"""

from __future__ import annotations

import logging
import os
from typing import Any, NamedTuple

import torch

__all__ = ["SMALL_MODEL_PARAMETERS", "ThreadChoice", "choose_cpu_threads", "set_cpu_threads"]

logger = logging.getLogger(__name__)

#: Below this many parameters a CPU run uses one intra-op thread: the built-in tiny model
#: (103,104) and tiny VLM (174,368). Measured on 2 cores by ``bench/quickstart_threads.py
#: --sweep`` (the quick start on tiny models of several widths, median step, one thread over
#: two): at width 64 1.05x quiet and 0.26x busy; at width 256 (1,297,152 parameters) 1.47x
#: quiet and 0.48x busy. The bound sits between: above it the second thread's gain on an idle
#: machine grows with the model, and a busy one is the user's to tune (``cpu_threads``).
SMALL_MODEL_PARAMETERS = 1_000_000

_ENV_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# torch's count before any run of this package set it, and the count it last set: a count
# that is neither was set by the user
_TORCH_DEFAULT = torch.get_num_threads()
_ours: int | None = None


class ThreadChoice(NamedTuple):
    """The intra-op thread count for a run, and what decided it (for the log)."""

    threads: int
    why: str


def choose_cpu_threads(parameters: int, configured: int | None = None) -> ThreadChoice:
    """The intra-op thread count a CPU run on a model of ``parameters`` parameters uses.

    Args:
        parameters: The policy's parameter count.
        configured: The manifest's ``training.cpu_threads`` (``None``: decide).

    Returns:
        The count, and what decided it: the manifest, the environment, the user's
        ``torch.set_num_threads``, or the model's size.
    """
    if configured is not None:
        return ThreadChoice(configured, "training.cpu_threads")
    for name in _ENV_VARIABLES:
        if os.environ.get(name, "").strip():
            return ThreadChoice(torch.get_num_threads(), name)
    current = torch.get_num_threads()
    if current not in (_TORCH_DEFAULT, _ours):
        return ThreadChoice(current, "torch.set_num_threads")
    if parameters < SMALL_MODEL_PARAMETERS:
        return ThreadChoice(1, f"a small model ({parameters:,} parameters)")
    return ThreadChoice(_TORCH_DEFAULT, f"torch's default for {parameters:,} parameters")


def set_cpu_threads(model: Any, configured: int | None, device: torch.device) -> int | None:
    """Set torch's intra-op threads for a run of ``model`` on ``device`` and log the choice.

    Args:
        model: The policy (its parameters are counted; a wrapper's are the model's).
        configured: The manifest's ``training.cpu_threads``.
        device: The run's device; on anything but the CPU nothing is set.

    Returns:
        The count set, or ``None`` off the CPU.
    """
    global _ours
    if device.type != "cpu":
        return None
    choice = choose_cpu_threads(sum(p.numel() for p in model.parameters()), configured)
    if choice.threads != torch.get_num_threads():
        torch.set_num_threads(choice.threads)
    _ours = choice.threads
    logger.info("torch intra-op threads: %d (%s)", choice.threads, choice.why)
    return choice.threads
