"""HealthPoller: the pool's outside view of its hosts, ``GET /health`` on each one in turn.

A host checks its own server too (:class:`~agile_llmenvs.hosting.host.Watchdog`), but a host
too stuck to run its own checks (its event loop blocked, its process stopped) never exits;
only a poll from outside sees it. This module never imports ray.
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import dataclass

__all__ = ["HealthPoller", "HealthTarget", "probe_health"]

_MAX_PROBE_THREADS = 8
# /health is served on loopback or the cluster network: never through a proxy
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class HealthTarget:
    """One host to poll: its index, its generation (a new one after each restart) and URL."""

    index: int
    generation: int
    url: str


class HealthPoller:
    """Polls every target's ``/health`` every ``interval_s`` on a daemon thread; a target that
    fails ``failures_to_replace`` polls in a row is handed to ``on_failing``.

    A failed poll is an answer other than 200, or none within ``timeout_s``. The count of a
    host starts again after a good poll and when its generation changes.

    Args:
        targets: The hosts to poll now (the ready ones).
        on_failing: Called with the failing target and the last poll's failure.
        interval_s: Seconds between rounds.
        timeout_s: Seconds one poll waits for its answer.
        failures_to_replace: Failed polls in a row that make a host failing.
    """

    def __init__(
        self,
        targets: Callable[[], list[HealthTarget]],
        on_failing: Callable[[HealthTarget, str], None],
        *,
        interval_s: float,
        timeout_s: float,
        failures_to_replace: int,
    ) -> None:
        self.targets, self.on_failing = targets, on_failing
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.failures_to_replace = failures_to_replace
        self._failures: dict[tuple[int, int], int] = {}
        self._stop = threading.Event()
        self._probes = ThreadPoolExecutor(_MAX_PROBE_THREADS, thread_name_prefix="env-host-health")
        self._thread = threading.Thread(target=self._poll, name="env-host-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling (a poll in flight is left to time out)."""
        self._stop.set()
        self._probes.shutdown(wait=False, cancel_futures=True)

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll_once()

    def poll_once(self) -> None:
        """One round: probe every target at once, then count and report the failures."""
        targets = self.targets()
        try:
            results = list(self._probes.map(lambda t: probe_health(t.url, self.timeout_s), targets))
        except (RuntimeError, CancelledError):  # stopped during the round
            return
        polled = {(t.index, t.generation) for t in targets}
        self._failures = {key: n for key, n in self._failures.items() if key in polled}
        for target, failure in zip(targets, results, strict=True):
            key = (target.index, target.generation)
            if failure is None:
                self._failures.pop(key, None)
                continue
            self._failures[key] = self._failures.get(key, 0) + 1
            if self._failures[key] >= self.failures_to_replace and not self._stop.is_set():
                del self._failures[key]
                self.on_failing(
                    target,
                    f"{self.failures_to_replace} health polls failed in a row; the last: {failure}",
                )


def probe_health(url: str, timeout_s: float) -> str | None:
    """Why ``GET {url}/health`` failed, or None when it answered 200 within ``timeout_s``."""
    try:
        with _OPENER.open(f"{url}/health", timeout=timeout_s) as reply:
            status = reply.status
    except urllib.error.HTTPError as exc:
        return f"GET /health answered HTTP {exc.code}: {_body(exc)}"
    except TimeoutError:
        return f"GET /health did not answer within {timeout_s} s"
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, TimeoutError):
            return f"GET /health did not answer within {timeout_s} s"
        return f"GET /health failed: {reason}"
    return None if status == 200 else f"GET /health answered HTTP {status}"


def _body(exc: urllib.error.HTTPError) -> str:
    try:
        return exc.read(500).decode("utf-8", "replace").strip()
    except OSError:
        return ""
