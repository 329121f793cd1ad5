"""The KV cache's memory: blocks of its own, or pages of the residency engine's ledger.

Split (the default): the KV cache owns ``num_blocks`` blocks and a
``kvcache.BlockAllocator`` gives them out. Joint (``--memory-ledger joint``;
docs/design.md, Joint memory ledger): the KV cache and the adapter slots are
carved from one ``arena.PageArena`` and the residency engine's ``PagePool``
owns every page; :class:`LedgerBlocks` gives the engine the allocator's
interface over that pool, so a sequence's blocks are KV pages of the ledger
(owner ``kv <request id>``), taken lowest page first, and growing them may
evict idle adapters (docs/design.md, Eviction eligibility) rather than preempt
rows. Must not know scheduling: the scheduler decides who gets blocks.
"""

from __future__ import annotations

from mlora.batch.adapters.residency.errors import AdmissionError, KVCapacity
from mlora.batch.model.kvcache import BlockAllocator, KVCache, KVCacheFull


def kv_memory(model, bank, arena, num_blocks: int, block_size: int, scratch: bool):
    """(KV cache, block allocator, most blocks one row may hold) of ``num_blocks`` blocks of
    ``block_size`` tokens for ``model``, with one more block that no sequence owns when
    ``scratch`` (the decode graphs' padded rows write there). With ``arena`` the blocks are
    its ledger pages: ``bank`` (a ResidencyBank) must be carved from it, ``num_blocks`` be
    its pages and its one spare page the scratch block; a row then holds its KV beside at
    least one adapter slot."""
    cfg = model.config
    shape = (cfg.num_layers, num_blocks + int(scratch), block_size, cfg.num_kv_heads, cfg.head_dim,
             model.dtype, model.device)
    if arena is None:
        return KVCache(*shape), BlockAllocator(num_blocks), num_blocks
    if bank is None or bank.arena is not arena or arena.num_pages != num_blocks or arena.spare_pages != int(scratch):
        raise ValueError("the joint memory mode needs a bank carved from this arena, num_blocks = its "
                         "ledger pages and one spare page with CUDA graphs")
    pages = arena.kv_pages(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    residency = bank.residency
    return (KVCache(*shape, pages=pages), LedgerBlocks(residency),
            num_blocks - residency.storage.pages_per_slot)


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
    """The ledger's KV owner of a sequence: its input row position (unique among the rows in
    flight, where ids may repeat; a preempted sequence gives its pages back before it is
    admitted again)."""
    return f"kv row {owner.req.row}"
