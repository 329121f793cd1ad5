"""KV blocks drawn from the residency engine's ledger: the joint (one arena) memory mode.

With ``--memory-ledger joint`` the KV cache and the adapter slots are carved from one
``arena.PageArena`` and the residency engine's ``PagePool`` owns every page
(docs/sizing.md): :class:`LedgerBlocks` gives the engine the interface of
``kvcache.BlockAllocator`` over that pool, so a sequence's blocks are KV pages of the
ledger (owner ``kv <request id>``), taken lowest page first, and growing them may evict
idle adapters (the residency engine's eligibility and ranking, spec 0x05C-0x05D) rather
than preempt rows. Must not know scheduling: the engine decides who gets blocks.
"""

from __future__ import annotations

from mlora.batch.model.kvcache import KVCacheFull
from mlora.batch.adapters.residency.errors import AdmissionError, KVCapacity


class LedgerBlocks:
    """``num_free`` / ``allocate`` / ``free`` of ``BlockAllocator`` over ``residency``'s pages.
    All or nothing, as the allocator: ``allocate`` returns ``n`` pages or raises KVCacheFull
    having taken none."""

    def __init__(self, residency):
        self.res = residency
        self.held = 0  # pages the KV cache holds now (every sequence's blocks)
        self.peak = 0  # most pages the KV cache held at once

    @property
    def num_free(self) -> int:
        """Pages a sequence could get now: free ones and those of adapters that may be evicted."""
        d = self.res.demand()
        return max(0, d.available - d.guard)

    def has(self, n: int) -> bool:
        """Whether ``n`` pages could be given now; the eviction candidates are ranked only when
        the free pages alone do not suffice (every decode step asks)."""
        if n <= self.res.pool.free_count - self.res.guard_pages:
            return True
        return n <= self.num_free

    def allocate(self, n: int, owner) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n == 0:
            return []
        name = owner_name(owner)
        try:
            pages = self.res.grow_kv(name, n) if self.res.holds_kv(name) else self.res.take_kv(name, n)
        except (KVCapacity, AdmissionError):
            raise KVCacheFull(n, self.num_free) from None
        self.held += len(pages)
        self.peak = max(self.peak, self.held)
        return pages

    def free(self, blocks: list[int], owner) -> None:
        """Give back every block of ``owner`` (``blocks``: all of them, as the engine frees a
        sequence's blocks at once)."""
        if blocks:
            self.res.release_kv(owner_name(owner))
            self.held -= len(blocks)


def owner_name(owner) -> str:
    """The ledger's KV owner of a sequence (its request id: unique in a job, and a preempted
    sequence gives its pages back before it is admitted again)."""
    return f"kv {owner.req.id}"
