"""What the engine may ask of an adapter bank: the :class:`AdapterBank` protocol.

Every bank the engine serves from (``ResidencyBank``, ``BundleBank``, ``SlotBank``)
implements all of it. A bank without a capability implements it as a no-op
(:class:`BlockingLoads`) and says so through ``loads_ahead``, so the engine calls
each method plainly and never asks a bank whether it has one. Must not know
scheduling or the model's layer code.

One invocation, as the engine drives it::

    ensure(adapters) -> {adapter: slot}     make every adapter of the invocation resident
    acquire(row, adapter)                    a running row's lease (released when it leaves)
    context(row_slots) -> LoraContext        what the model applies at every target group

Between invocations a bank with ``loads_ahead`` also takes hints (``want``), builds
host images ahead (``prefetch``), starts loads that overlap the device's work
(``prefetch_device``, ``start_load``) and publishes them (``commit_device``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from mlora.batch.model.lora import LoraContext


class GraphLora(NamedTuple):
    """The LoRA side of one captured decode graph: the context the captured forward reads,
    and the static object (a launch plan, or a row buffer) that ``context(row_slots,
    static=...)`` refills before each replay."""

    context: LoraContext
    static: Any


class BankCounters(Protocol):
    """The counters every bank keeps (hits, misses, loads, evictions, ...)."""

    evictions: int

    def as_dict(self) -> dict: ...


@runtime_checkable
class AdapterBank(Protocol):
    """The engine's view of the adapters on the device (docs/design.md, Slot)."""

    num_slots: int  # adapters resident at once
    max_rank: int  # the slots' physical rank (docs/design.md, Logical and physical rank)
    stats: BankCounters
    # True: the bank starts loads without waiting for them and builds host images ahead
    # (docs/design.md, Prefetch); False: every load happens, blocking, inside ensure
    loads_ahead: bool
    arena: Any  # the page arena its slots are carved from (docs/design.md, Joint memory ledger), or None
    residency: Any  # the residency engine behind the bank, or None (the joint memory ledger needs one)

    @property
    def resident(self) -> dict[str, int]:
        """semantic_sha256 -> slot of every resident adapter, least recently used first."""
        ...

    def ensure(self, adapter_ids: list[str], pinned: dict) -> dict[str, int]:
        """Make every listed adapter resident; adapter id -> slot."""
        ...

    def context(self, row_slots: torch.Tensor, static=None) -> LoraContext:
        """The LoRA context of one invocation (``row_slots``: each packed row's slot, -1 = base)."""
        ...

    def graph_lora(self, rows: int) -> GraphLora:
        """The LoRA context a decode graph of ``rows`` rows is captured with, and its static buffers."""
        ...

    def source_tier(self, adapter_id: str, pinned: dict) -> str:
        """Where a load of the adapter would copy from now: "device", "host" or "disk"."""
        ...

    def acquire(self, request: str, adapter_id: str, pinned: dict) -> Any:
        """Lease the adapter for request attempt ``request`` (docs/design.md, Lease)."""
        ...

    def release(self, request: str) -> None:
        """End the lease of ``request``."""
        ...

    def want(self, adapter_ids, pinned: dict) -> None:
        """The adapters queued rows still name (an eviction ranking hint)."""
        ...

    def prefetch(self, adapter_ids: list[str], pinned: dict) -> int:
        """Start building host images of the listed adapters; how many builds started."""
        ...

    def prefetch_device(self, adapter_ids: list[str], pinned: dict, limit: int) -> int:
        """Start loads of up to ``limit`` of the listed adapters into free or unneeded slots."""
        ...

    def prefetch_counts(self) -> tuple[int, int]:
        """(host images built ahead, of those used by a load) over the bank's life."""
        ...

    def start_load(self, adapter_id: str, pinned: dict) -> str:
        """Start one adapter's load without waiting: "resident", "loading", "started",
        "building", "no-room" or "sync" (load it inside ensure)."""
        ...

    def load_now(self, adapter_id: str, pinned: dict) -> bool:
        """Load one adapter now, blocking; False when no slot can be had now."""
        ...

    def loads_in_flight(self) -> int:
        """Loads started ahead and not yet published."""
        ...

    def end_invocation(self) -> None:
        """The previous invocation's device work has completed."""
        ...

    def commit_device(self) -> list[tuple[str, float]]:
        """Publish every load started ahead: (adapter id, seconds waited) of each."""
        ...

    def report(self) -> dict:
        """The bank's figures for the job summary."""
        ...

    def close(self) -> None:
        """Stop whatever runs in the background."""
        ...


class BlockingLoads:
    """The protocol's hooks for a bank whose loads all happen, blocking, inside ``ensure``:
    no leases, no hints, nothing built or loaded ahead (``loads_ahead`` False), no arena."""

    loads_ahead = False
    arena = None
    residency = None

    def source_tier(self, adapter_id: str, pinned: dict) -> str:
        return "disk"

    def acquire(self, request: str, adapter_id: str, pinned: dict) -> None:
        return None

    def release(self, request: str) -> None:
        return None

    def want(self, adapter_ids, pinned: dict) -> None:
        return None

    def prefetch(self, adapter_ids: list[str], pinned: dict) -> int:
        return 0

    def prefetch_device(self, adapter_ids: list[str], pinned: dict, limit: int) -> int:
        return 0

    def prefetch_counts(self) -> tuple[int, int]:
        return 0, 0

    def start_load(self, adapter_id: str, pinned: dict) -> str:
        return "sync"

    def load_now(self, adapter_id: str, pinned: dict) -> bool:
        self.ensure([adapter_id], pinned)
        return True

    def loads_in_flight(self) -> int:
        return 0

    def end_invocation(self) -> None:
        return None

    def commit_device(self) -> list[tuple[str, float]]:
        return []

    def report(self) -> dict:
        return self.stats.as_dict()

    def close(self) -> None:
        return None
