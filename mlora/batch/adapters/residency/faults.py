"""Test-only fault injection at the named points of a load transaction.

Owns the armed faults and the record of which fired. The residency manager
consults it at three points of every attempt (restorations of victims
included); production code passes no injector. Points and actions::

    "host"      fail                     reading the verified host source
    "copy"      fail                     after the slot was zeroed and the first piece landed (a partial overwrite)
                corrupt(where=...)       after every piece landed: "tail" (a stale value in a padded tail),
                                         "value" (one factor element changed), "nan", "scale" (a scale on an
                                         untargeted slice)
                delay(polls=n) / hold    the copy-complete event completes after n polls / when completed by hand
    "validate"  fail                     validation reports a failure (default E_VALIDATE_DIGEST)
                delay / hold             the validation result arrives late

A fault matches an attempt by adapter (the residency key or the artifact's
human name) and attempt number (1-based, per adapter, counting every load of
that adapter including restorations); ``None`` matches any. ``times=None``
keeps it armed for ever (a permanent failure).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mlora.batch.adapters.residency.errors import LoadError, ResidencyError, ValidationError
from mlora.batch.adapters.residency.events import Event, ManualEvent

_FAIL = {"host": ("E_RESIDENCY_HOST_SOURCE", ResidencyError), "copy": ("E_RESIDENCY_COPY", LoadError),
         "validate": ("E_VALIDATE_DIGEST", ValidationError)}


@dataclass
class Fault:
    point: str
    action: str  # fail | corrupt | delay | hold
    adapter: str | None = None
    attempt: int | None = None
    times: int | None = 1
    code: str | None = None
    polls: int | None = None
    where: str = "tail"
    fired: int = 0
    events: list[ManualEvent] = field(default_factory=list)

    def matches(self, point: str, action: str, key: str, name: str, attempt: int) -> bool:
        return (self.point == point and self.action == action and (self.times is None or self.fired < self.times)
                and self.adapter in (None, key, name) and self.attempt in (None, attempt))

    def complete(self) -> None:
        """Complete every event this (delay/hold) fault issued."""
        for e in self.events:
            e.complete()


class FaultInjector:
    def __init__(self):
        self.faults: list[Fault] = []
        self.log: list[tuple[str, str, str, int]] = []  # (point, action, adapter name, attempt) as fired

    def fail(self, point: str, adapter: str | None = None, attempt: int | None = None, times: int | None = 1,
             code: str | None = None) -> Fault:
        if point not in _FAIL:
            raise ValueError(f"unknown fault point {point!r}; expected one of {sorted(_FAIL)}")
        return self._arm(Fault(point, "fail", adapter, attempt, times, code))

    def corrupt(self, adapter: str | None = None, attempt: int | None = None, where: str = "tail",
                times: int | None = 1) -> Fault:
        if where not in ("tail", "value", "nan", "scale"):
            raise ValueError(f"unknown corruption {where!r}")
        return self._arm(Fault("copy", "corrupt", adapter, attempt, times, where=where))

    def delay(self, point: str, adapter: str | None = None, attempt: int | None = None, polls: int = 1,
              times: int | None = 1) -> Fault:
        return self._arm(Fault(point, "delay", adapter, attempt, times, polls=polls))

    def hold(self, point: str, adapter: str | None = None, attempt: int | None = None,
             times: int | None = 1) -> Fault:
        return self._arm(Fault(point, "hold", adapter, attempt, times))

    def _arm(self, fault: Fault) -> Fault:
        if fault.action in ("delay", "hold") and fault.point not in ("copy", "validate"):
            raise ValueError("only 'copy' and 'validate' can be delayed or held")
        self.faults.append(fault)
        return fault

    def _fire(self, point: str, action: str, key: str, name: str, attempt: int) -> Fault | None:
        for f in self.faults:
            if f.matches(point, action, key, name, attempt):
                f.fired += 1
                self.log.append((point, action, name, attempt))
                return f
        return None

    # ---- hooks the manager calls ---------------------------------------------------

    def check(self, point: str, key: str, name: str, attempt: int) -> None:
        f = self._fire(point, "fail", key, name, attempt)
        if f is not None:
            code, cls = _FAIL[point]
            raise cls(f.code or code, f"injected {point} failure for adapter {name!r}, attempt {attempt}")

    def event(self, point: str, key: str, name: str, attempt: int, event: Event) -> Event:
        for action in ("delay", "hold"):
            f = self._fire(point, action, key, name, attempt)
            if f is not None:
                e = ManualEvent(f.polls if action == "delay" else None, f"{point} {name}#{attempt}")
                f.events.append(e)
                return e
        return event

    def corrupt_views(self, key: str, name: str, attempt: int, views: dict[str, torch.Tensor], pieces) -> None:
        f = self._fire("copy", "corrupt", key, name, attempt)
        if f is None:
            return
        if f.where == "scale":
            _bad_scale(views)
            return
        if f.where == "tail" and _poke_tail(views, pieces):
            return
        p = pieces[0]
        region = views[p.view][p.index]
        first = (0,) * region.dim()
        if f.where == "nan":
            region[first] = float("nan")
        else:
            region[first] = region[first] + 1


def _poke_tail(views: dict[str, torch.Tensor], pieces) -> bool:
    """Write 1 at the first position of a view that no piece covers (a padded tail)."""
    for name, v in views.items():
        mask = torch.zeros(v.shape, dtype=torch.bool)
        for p in pieces:
            if p.view == name:
                mask[p.index] = True
        free = (~mask).nonzero()
        if len(free):
            v[tuple(free[0].tolist())] = 1
            return True
    return False


def _bad_scale(views: dict[str, torch.Tensor]) -> None:
    """A scale on a slice the adapter does not target (rank 0), else a NaN scale."""
    for name, v in views.items():
        if name.startswith("scales."):
            ranks = views["ranks." + name.split(".", 1)[1]].to("cpu")
            untargeted = (ranks == 0).nonzero()
            v[tuple(untargeted[0].tolist()) if len(untargeted) else (0,) * v.dim()] = (
                0.5 if len(untargeted) else float("nan"))
            return
    raise ValueError("corrupt(where='scale') needs a storage with 'scales.*' and 'ranks.*' views")
