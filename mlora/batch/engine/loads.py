"""The engine's adapter traffic: every call that brings an adapter into a slot, counted.

Owns the engine's calls into its adapter bank that load adapters (an
invocation's ``ensure``, the publication of loads started ahead, the joint
memory ledger's blocking loads, host- and GPU-tier prefetch) and what each
adds to the job's metrics: cache hits per tier, loads with their bytes, latency
and source tier, evictions, prefetches. Must not choose adapters: the
scheduler decides which ones, this room only moves them.
"""

from __future__ import annotations

import time

from mlora.batch.adapters.catalog import AdapterError


def stored_adapter_bytes(pinned) -> int:
    """Bytes of an adapter's factors as stored (what a load moves)."""
    return sum(m.a.nbytes + m.b.nbytes for m in pinned.modules)


class AdapterLoads:
    """Loads through ``bank`` for the adapters of ``pinned``, counted in ``metrics``
    (a ``mlora.batch.job.metrics.JobMetrics``, or None: nothing counted)."""

    def __init__(self, bank, pinned: dict, metrics):
        self.bank, self.pinned, self.metrics = bank, pinned, metrics
        self.seen: set[str] = set()  # adapters some invocation ran with (counted while metrics are on)
        # prefetches before this engine (e.g. a preload's) are not its own
        self._prefetch_seen = bank.prefetch_counts() if bank is not None else (0, 0)

    def ensure(self, adapters: list[str]) -> dict[str, int]:
        """``bank.ensure`` of one invocation, with load, cache and eviction metrics (loads
        started ahead are published before the schedule: :meth:`commit`)."""
        if not self.metrics:
            return self.bank.ensure(adapters, self.pinned)
        before = dict(self.bank.resident)
        # where a load will copy from: the host cache (e.g. prefetched) or disk
        tiers = {a: self.bank.source_tier(a, self.pinned) for a in adapters if self.pinned[a].semantic_sha256 not in before}
        evictions = self.bank.stats.evictions
        t0 = time.perf_counter()
        slot_of = self.bank.ensure(adapters, self.pinned)
        seconds = time.perf_counter() - t0
        loaded = [a for a in adapters if self.pinned[a].semantic_sha256 not in before]
        for a in adapters:
            self.metrics.cache(a not in loaded, "device")
            if a not in self.seen:
                self.seen.add(a)
                self.metrics.unique_adapter_bytes(stored_adapter_bytes(self.pinned[a]))
        for a in dict.fromkeys(loaded):
            self.metrics.cache(tiers[a] == "host", "host")
            self.metrics.adapter_load(stored_adapter_bytes(self.pinned[a]), seconds / max(len(loaded), 1), True, tiers[a])
        self._count_evictions(evictions)
        return slot_of

    def commit(self) -> None:
        """Publish the loads started ahead (admission's asynchronous loads, GPU-tier
        prefetch): counted as loads from the host tier, with the time the engine waited
        for them (the part that did not overlap device work) as their latency."""
        evictions = self.bank.stats.evictions
        done = self.bank.commit_device()
        if self.metrics:
            for a, seconds in done:
                self.metrics.cache(True, "host")
                self.metrics.adapter_load(stored_adapter_bytes(self.pinned[a]), seconds, True, "host")
            self._count_evictions(evictions)

    def load_now(self, adapter: str) -> bool:
        """Joint memory ledger: load ``adapter`` now, the blocking way; False when no slot's pages
        can be had now. A load that fails for the adapter's own reasons says True: the row is
        admitted and the forward's load raises the error where the engine fails its rows."""
        tier = self.bank.source_tier(adapter, self.pinned)  # host cache or disk, before the load
        evictions, t0 = self.bank.stats.evictions, time.perf_counter()
        try:
            if not self.bank.load_now(adapter, self.pinned):
                return False
        except AdapterError:
            return True
        if self.metrics:  # as a load started ahead (commit): the forward's ensure counts the device hit
            self.metrics.cache(tier == "host", "host")
            self.metrics.adapter_load(stored_adapter_bytes(self.pinned[adapter]), time.perf_counter() - t0, True, tier)
            self._count_evictions(evictions)
        return True

    def prefetch(self, cold: list[str], planned: set[str], gpu_limit: int) -> None:
        """Ask the bank to build the host images of ``cold`` (in that order) in the background,
        and to start loading up to ``gpu_limit`` of those in ``planned`` (the next admission's)
        into free or unneeded slots; count the prefetches."""
        if cold:
            self.bank.prefetch(cold, self.pinned)
            if gpu_limit:
                # images already built start copying to the GPU now, on the side stream; only for
                # the adapters the next admission gives slots to (a prefetched adapter that waits
                # longer would hold a slot the next admissions need, and be evicted unused)
                self.bank.prefetch_device([a for a in cold if a in planned], self.pinned, gpu_limit)
        if self.metrics:
            (issued, used), (seen_issued, seen_used) = self.bank.prefetch_counts(), self._prefetch_seen
            self.metrics.prefetch(issued - seen_issued, used - seen_used)
            self._prefetch_seen = (issued, used)

    def _count_evictions(self, before: int) -> None:
        """Device evictions since the bank's eviction count was ``before``, into the metrics."""
        for _ in range(self.bank.stats.evictions - before):
            self.metrics.eviction("device")
