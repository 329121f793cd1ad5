"""Device events and the copy engine behind the residency transaction.

Owns the ``Event`` protocol (``query()`` true once the work before it is done,
``synchronize()`` waits for it) and the ``Copier`` that moves adapter bytes
into slot storage. Must not know adapters or states.

Two copiers, one protocol:

* :class:`CpuCopier` -- the "device" is the CPU: copies run synchronously and
  every event it records is already complete. CI runs every state transition
  through it; the fault injector can replace its events by slow or held ones.
* :class:`CudaCopier` -- copies are issued on a side stream with
  ``non_blocking=True`` from pinned host memory, ``record()`` returns a
  ``torch.cuda.Event`` recorded on that stream (it satisfies the protocol as
  it is), and ``wait(event)`` makes later copies wait for a compute-stream
  event (a victim's last use) without blocking the host.
"""

from __future__ import annotations

import contextlib
import time
from typing import Protocol

import torch


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class DoneEvent:
    """An event whose work has completed."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return "DONE"


DONE = DoneEvent()


class StampEvent(DoneEvent):
    """A completed event that remembers when it was recorded (the CPU copier's timing marks:
    its copies are synchronous, so the time between two stamps is the copies' time)."""

    def __init__(self):
        self.t = time.perf_counter()


class ManualEvent:
    """A CPU stand-in for a slow device event (fault injection, tests).

    Incomplete until :meth:`complete` is called, or until it has been queried
    ``polls`` times when ``polls`` is given (a transfer that takes that many
    scheduler ticks). :meth:`synchronize` models the host waiting for the
    device: the work finishes and the event completes."""

    def __init__(self, polls: int | None = None, label: str = ""):
        self.done, self.polls, self.label = False, polls, label

    def complete(self) -> None:
        self.done = True

    def query(self) -> bool:
        if not self.done and self.polls is not None:
            self.polls -= 1
            self.done = self.polls <= 0
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def __repr__(self) -> str:
        return f"ManualEvent({self.label!r}, done={self.done})"


def complete(event: Event | None) -> bool:
    return event is None or event.query()


class Copier(Protocol):
    def wait(self, event: Event | None) -> None:
        """Order every later copy after ``event`` (a slot's last use)."""

    def zero(self, dst: torch.Tensor) -> None: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def record(self) -> Event:
        """An event that completes once every copy issued so far has landed."""

    def mark(self) -> Event:
        """A timing mark on the copy stream: like ``record``, and :meth:`elapsed` measures
        the device time between two marks once both completed."""

    def elapsed(self, start: Event, end: Event) -> float | None:
        """Seconds the copy stream spent between two completed marks (None if unknown)."""

    def compute_event(self) -> Event:
        """An event after the work issued so far on the compute stream (a launch's last use)."""

    def side(self):
        """A context for device work on landed bytes (validation), ordered after the copies."""


class CpuCopier:
    def wait(self, event: Event | None) -> None:
        if event is not None:
            event.synchronize()

    def zero(self, dst: torch.Tensor) -> None:
        dst.zero_()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self) -> Event:
        return DONE

    def mark(self) -> Event:
        return StampEvent()

    def elapsed(self, start: Event, end: Event) -> float | None:
        if isinstance(start, StampEvent) and isinstance(end, StampEvent):
            return end.t - start.t
        return None

    def compute_event(self) -> Event:
        return DONE

    def side(self):
        """Synchronous copies: validation runs where it is called."""
        return contextlib.nullcontext()


COPY_STREAM_PRIORITY = -1  # lower is higher (torch.cuda.Stream); the compute stream is at 0


class CudaCopier:
    """Copies on a dedicated side stream; host sources must be pinned and stay alive until
    the recorded event completes (the residency transaction keeps its artifact until then)."""

    def __init__(self, device):
        self.device = torch.device(device)
        # high priority: a load's validation kernels (a few microseconds of work) get SMs as
        # soon as the compute stream's running blocks retire, instead of after every block of
        # the kernel queued there (a prefill GEMM). Copies use copy engines at any priority; the
        # mean load time does not depend on it (BENCHMARKS.md, residency).
        self.stream = torch.cuda.Stream(self.device, priority=COPY_STREAM_PRIORITY)
        self._inside = False  # within side(): the copy stream is already current

    def wait(self, event: Event | None) -> None:
        if event is None:
            return
        if isinstance(event, torch.cuda.Event):
            self.stream.wait_event(event)
        else:
            event.synchronize()

    def zero(self, dst: torch.Tensor) -> None:
        with self._on_stream():
            dst.zero_()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self._on_stream():
            dst.copy_(src, non_blocking=True)

    def _on_stream(self):
        """The copy stream's context, or nothing inside :meth:`side` (already on it)."""
        return contextlib.nullcontext() if self._inside else torch.cuda.stream(self.stream)

    def record(self) -> Event:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def mark(self) -> Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def elapsed(self, start: Event, end: Event) -> float | None:
        if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            end.synchronize()  # recorded right after the validation reads the caller already waited for
            return start.elapsed_time(end) / 1e3
        return None

    def compute_event(self) -> Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def side(self):
        """Context in which device work (load validation) runs on the copy stream: its
        result read-back waits for the copy, never for the compute stream's queued
        iterations (which would stall the host for about one forward per load). Copies
        and zeros issued inside it skip their own stream switch. Engine thread only."""
        outer = self._inside
        with torch.cuda.stream(self.stream):
            self._inside = True
            try:
                yield
            finally:
                self._inside = outer


def copier_for(device) -> Copier:
    device = torch.device(device)
    return CudaCopier(device) if device.type == "cuda" else CpuCopier()
