"""The cyclic garbage collector's pauses while a job runs, and the opt-in regimes of MLORA_GC.

CPython's collector stops whichever thread triggered it (it holds the interpreter
lock: every other Python thread waits too). In the engine's process on this
project's CPU (twenty-second session, a tiny residency job) a generation-0
collection took ~0.04 ms, a generation-1 one 0.2-4 ms (one in ten) and a full one
130 ms with torch and Triton loaded: the generation-1 ones are the size of the
H200 job's unexplained p90 in a cold load's host issue (~1 ms more CPU time than
the median). :data:`PAUSES` counts every collection by generation and sums
its wall time, so a timed span can say how much of it was collection
(``PAUSES.total()`` before and after: the residency engine's load issue does).

``MLORA_GC`` (A/B runs): ``freeze``: once a session is built (weights, slot bank,
engine), ``gc.freeze()`` moves every object alive into the permanent generation,
so full collections no longer walk them; ``close`` unfreezes them, so a finished
session's reference cycles are collected again (``job.release_device_memory``).
``device-wait``: the same freeze, and automatic collection off while the session
runs: the :class:`DeviceWaitCollector` runs the collections Python would have run
(the same thresholds) at one point of each engine iteration, after its host work
and right before sampling waits for the device, where the device's own work hides
them; a cold load's issue (admission) then never contains one.
"""

from __future__ import annotations

import gc
import time

from mlora.batch.envknobs import env_choice

GC_MODES = ("default", "freeze", "device-wait")


def gc_mode() -> str:
    """``MLORA_GC``: ``default`` (the collector as Python sets it), ``freeze`` or ``device-wait``."""
    return env_choice("MLORA_GC", GC_MODES, "default")


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


class DeviceWaitCollector:
    """Automatic collection off (``gc.disable``) until :meth:`close`; calling the collector
    runs the collection the interpreter would have run by now, if any: generation 0 once
    ``threshold0`` more containers were allocated than freed, every ``threshold1``-th of
    those generation 1, every ``threshold2``-th of those generation 2 (``gc.get_threshold``).
    Every thread's allocations count (prefetch threads' too); a process whose engine stops
    calling it collects nothing until :meth:`close` re-enables collection. ``ran``: the
    collections it ran, by generation."""

    def __init__(self):
        self.thresholds = gc.get_threshold()
        self.ran = [0, 0, 0]
        self._young = self._middle = 0  # generation-0 runs since the last 1; generation-1 since the last 2
        self._was_enabled = gc.isenabled()
        gc.disable()

    def __call__(self) -> None:
        t0, t1, t2 = self.thresholds
        if t0 <= 0 or gc.get_count()[0] < t0:
            return
        generation = 0
        self._young += 1
        if self._young >= t1:
            self._young, generation = 0, 1
            self._middle += 1
            if self._middle >= t2:
                self._middle, generation = 0, 2
        gc.collect(generation)
        self.ran[generation] += 1

    def close(self) -> None:
        if self._was_enabled:
            gc.enable()
            self._was_enabled = False


class GcRegime:
    """``MLORA_GC``'s mode for one engine's run, and the collector's pauses during it.

    Made before the engine (``mode`` read then: a malformed value is refused before any
    weights load); :meth:`start` once the engine is built (the pause count starts, the
    freeze and the device-wait collector apply); :meth:`stats` any time after (live until
    :meth:`close`, fixed by it); :meth:`close` unfreezes, re-enables automatic collection
    and stops counting (idempotent)."""

    def __init__(self, mode: str | None = None):
        self.mode = mode or gc_mode()
        self._since = None
        self._final: dict | None = None
        self._frozen = False
        self.collector: DeviceWaitCollector | None = None

    def start(self, engine) -> None:
        # device-wait: automatic collection off before the counting starts, so that every
        # collection counted is the collector's
        self.collector = DeviceWaitCollector() if self.mode == "device-wait" else None
        PAUSES.install()
        self._since = PAUSES.snapshot()
        PAUSES.reset_max()
        if self.mode in ("freeze", "device-wait"):  # what is alive now is long-lived
            gc.freeze()
            self._frozen = True
        engine.device_wait_hook = self.collector

    def stats(self) -> dict:
        """``gc_mode``, ``gc_collections`` / ``gc_pause_seconds`` by generation,
        ``gc_pause_max_ms`` since :meth:`start`, and ``gc_at_device_wait`` (by generation)
        in the device-wait mode. Empty before :meth:`start`."""
        if self._final is not None:
            return self._final
        if self._since is None:
            return {}
        out = dict(PAUSES.since(self._since), gc_mode=self.mode)
        if self.collector is not None:
            out["gc_at_device_wait"] = {str(g): n for g, n in enumerate(self.collector.ran)}
        return out

    def close(self) -> None:
        if self._since is not None and self._final is None:
            self._final = self.stats()
            PAUSES.uninstall()
        if self.collector is not None:
            self.collector.close()
        if self._frozen:  # the run's objects collectable again (a finished job's cycles)
            gc.unfreeze()
            self._frozen = False
