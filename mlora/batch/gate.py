"""A turn-taking gate between the engine thread and background builders (one job).

Python threads share one interpreter lock. While prefetch threads build adapter
images (file reads, digest checks, layout: Python glue between C calls), every
call of the engine thread that releases the lock (most torch calls do) may
have to wait to get it back; measured on the H200, a cold adapter load that
takes 1.8 ms alone took hundreds of ms next to two threads running Python
(``scripts/load_breakdown.py``). The engine's host work per iteration is short
and the device work long, so the builders should run while the engine waits
for the device, not while it schedules and launches.

:class:`Gate`: the engine holds :meth:`Gate.engine_turn` around its host work;
builder threads call :func:`pause_point` between small steps of their work
and, while the engine holds its turn, wait there (blocked on a condition, not
competing for the lock). A pause point on any other thread, or with no gate
installed on the thread, returns at once. Work done between pause points is
short (one module's tensors), so the engine waits for at most one such step.
Nothing here changes what a build computes, only when.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

_local = threading.local()


class Gate:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._engine = 0  # engine turns held (nested turns allowed)

    @contextmanager
    def engine_turn(self):
        """The engine's host work: builders pause at their next pause point."""
        with self._cv:
            self._engine += 1
        try:
            yield
        finally:
            with self._cv:
                self._engine -= 1
                if not self._engine:
                    self._cv.notify_all()

    @contextmanager
    def builders_run(self):
        """Inside an engine turn, let the builders run (the engine waits for one of their results)."""
        with self._cv:
            held, self._engine = self._engine, 0
            self._cv.notify_all()
        try:
            yield
        finally:
            with self._cv:
                self._engine += held

    def wait_turn(self) -> None:
        with self._cv:
            while self._engine:
                self._cv.wait()

    def install(self) -> None:
        """Make this gate the one the calling (builder) thread's pause points obey."""
        _local.gate = self


def pause_point() -> None:
    """Wait here while the engine holds its turn (builder threads with a gate installed only)."""
    gate = getattr(_local, "gate", None)
    if gate is not None:
        gate.wait_turn()
