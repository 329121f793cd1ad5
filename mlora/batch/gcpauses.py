"""The cyclic garbage collector's pauses while a job runs.

CPython's collector stops whichever thread triggered it (it holds the interpreter
lock: every other Python thread waits too). With torch and Triton loaded a
generation-0 collection takes tens of microseconds, a generation-1 one up to
milliseconds and a full one over a hundred, so a pause can stand out in a timed
span such as a cold load's host issue. :data:`PAUSES` counts every collection by
generation and sums its wall time, so a timed span can say how much of it was
collection (``PAUSES.total()`` before and after: the residency engine's load
issue does), and :class:`RunPauses` reports them over one engine's run. The
collector runs as Python configures it; nothing here changes when it runs.
"""

from __future__ import annotations

import gc
import time


class GcPauses:
    """Collections and their wall time in this process while at least one holder is installed.

    ``install``/``uninstall`` nest (one callback however many sessions hold it); counts
    and seconds accumulate over the process's life, so callers take differences."""

    def __init__(self):
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.max_seconds = 0.0
        self._holders = 0
        self._started: float | None = None

    def install(self) -> None:
        if self._holders == 0:
            gc.callbacks.append(self._callback)
        self._holders += 1

    def uninstall(self) -> None:
        if self._holders == 0:
            return
        self._holders -= 1
        if self._holders == 0:
            gc.callbacks.remove(self._callback)
            self._started = None

    def total(self) -> float:
        """Seconds of collection so far, every generation (0.0 if never installed)."""
        return sum(self.seconds)

    def snapshot(self) -> tuple[list[int], list[float]]:
        """(collections, seconds) by generation so far."""
        return list(self.collections), list(self.seconds)

    def since(self, snap) -> dict:
        """Collections and their seconds since ``snapshot()`` ``snap``, and the longest pause
        since the last :meth:`reset_max` (the process's life if never reset)."""
        counts, seconds = snap
        return {"gc_collections": {str(g): self.collections[g] - counts[g] for g in range(3)},
                "gc_pause_seconds": {str(g): round(self.seconds[g] - seconds[g], 6) for g in range(3)},
                "gc_pause_max_ms": round(self.max_seconds * 1e3, 3)}

    def reset_max(self) -> None:
        self.max_seconds = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:  # installed during a collection
            return
        took = time.perf_counter() - self._started
        self._started = None
        g = min(int(info.get("generation", 2)), 2)
        self.collections[g] += 1
        self.seconds[g] += took
        self.max_seconds = max(self.max_seconds, took)


PAUSES = GcPauses()


class RunPauses:
    """The collector's pauses over one engine's run: :meth:`start` once the engine is built,
    :meth:`stats` any time after (live until :meth:`close`, fixed by it), :meth:`close` stops
    counting (idempotent)."""

    def __init__(self):
        self._since = None
        self._final: dict | None = None

    def start(self) -> None:
        PAUSES.install()
        self._since = PAUSES.snapshot()
        PAUSES.reset_max()

    def stats(self) -> dict:
        """``gc_collections`` / ``gc_pause_seconds`` by generation and ``gc_pause_max_ms``
        since :meth:`start`; empty before it."""
        if self._final is not None:
            return self._final
        if self._since is None:
            return {}
        return PAUSES.since(self._since)

    def close(self) -> None:
        if self._since is not None and self._final is None:
            self._final = self.stats()
            PAUSES.uninstall()
