"""Memory readings the benchmark scripts share: the process's resident memory on a CPU, the
device's allocated memory on a GPU."""

from __future__ import annotations

import torch

__all__ = ["Memory", "status_kb"]


class Memory:
    """The process's resident memory (CPU) or the device's allocated memory (GPU), in GB.

    On a CPU the peak is the process's high-water mark (``VmHWM``), which :meth:`reset_peak`
    resets through ``/proc/self/clear_refs``.
    """

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def current(self) -> float:
        if self.cuda:
            return torch.cuda.memory_allocated() / 1e9
        return status_kb("VmRSS") / 1e6

    def peak(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated() / 1e9
        return status_kb("VmHWM") / 1e6

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as file:
                file.write("5")


def status_kb(key: str) -> int:
    """A field of ``/proc/self/status`` in kB (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")
