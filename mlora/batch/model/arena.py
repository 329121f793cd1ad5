"""One device arena of equal pages that KV blocks and adapter slots are both carved from.

Owns one device allocation of ``num_pages + spare_pages`` pages of ``page_bytes``
and the tensor views over it; it does not decide who owns a page (the residency
engine's ``PagePool`` over pages ``0 .. num_pages - 1`` does: KV blocks lowest page
first, adapter slots on fixed runs of pages at the top, docs/sizing.md). Spare
pages lie past the ledger's pages and belong to nobody in it (the decode graphs'
scratch KV block).

* :meth:`kv_pages` -- the page-major KV cache ``[pages, layers, 2, block_size,
  kv_heads, head_dim]`` over every page (``KVCache(pages=...)``): page ``p`` is KV
  block ``p``, so a page is exactly one block's K and V of every layer.
* :class:`SlotCarver` -- the slot tensors of a bank (``[S, ...]``, any dtype) as
  strided views: slot ``s`` of every tensor lies in pages ``first_page + s *
  pages_per_slot`` onwards, each tensor at a 256-byte aligned offset inside the
  slot's run of pages, so a slot's views are plain contiguous sub-tensors (one copy
  per view per load, as with separately allocated banks).
* :class:`ArenaShape` -- an arena's pages and slot runs, which a tensor-parallel
  follower rebuilds on its device so that page and slot ids name the same bytes
  on every rank (docs/scaleout.md).

Bytes on a page are whatever its last owner wrote: a slot's load writes every
element of its views (whole views, or zeros then pieces), and attention reads only
KV positions written in the cache before.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from mlora.batch.model.kvcache import KVCache

ALIGN = 256  # bytes: every slot tensor starts at a multiple (any dtype's alignment, vector loads)


def pages_per_slot(slot_bytes: int, tensors: int, page_bytes: int) -> int:
    """Pages of one slot's run: its ``slot_bytes`` of ``tensors`` slot tensors, each starting at
    the next ``ALIGN``-byte offset (at most ``ALIGN`` bytes of padding before each)."""
    return max(1, -(-(slot_bytes + ALIGN * tensors) // page_bytes))


class PageArena:
    def __init__(self, num_pages: int, page_bytes: int, device, spare_pages: int = 0):
        if num_pages < 1 or spare_pages < 0 or page_bytes < ALIGN or page_bytes % ALIGN:
            raise ValueError(f"an arena needs num_pages >= 1, spare_pages >= 0 and page_bytes a positive multiple of "
                             f"{ALIGN}, got {num_pages}, {spare_pages}, {page_bytes}")
        self.num_pages, self.spare_pages, self.page_bytes = num_pages, spare_pages, page_bytes
        self.device = torch.device(device)
        self.data = torch.zeros((num_pages + spare_pages) * page_bytes, dtype=torch.uint8, device=self.device)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def kv_pages(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> torch.Tensor:
        """Every page (spare ones last) as one page-major KV block; the page size must be one
        block's K and V of every layer."""
        block = KVCache.block_bytes(num_layers, block_size, num_kv_heads, head_dim, dtype)
        if block != self.page_bytes:
            raise ValueError(f"a KV block of this model is {block} bytes, the arena's pages {self.page_bytes}")
        return self.data.view(dtype).view(self.num_pages + self.spare_pages, num_layers, 2, block_size,
                                          num_kv_heads, head_dim)

    def carver(self, num_slots: int, pps: int) -> "SlotCarver":
        """Slots of ``pps`` pages each (:func:`pages_per_slot`) at the top of the ledger's pages:
        slot ``s`` starts at page ``first_page + s * pps``."""
        first = self.num_pages - num_slots * pps
        if num_slots < 1 or first < 0:
            raise ValueError(f"{num_slots} slots of {pps} pages do not fit in an arena of {self.num_pages} pages")
        return SlotCarver(self, num_slots, pps, first)


class ArenaShape(NamedTuple):
    """An arena's pages and its slots' runs: what another process needs to build an arena in which
    every page id and slot id names the same bytes (a tensor-parallel follower, docs/sizing.md)."""

    num_pages: int
    page_bytes: int
    spare_pages: int
    num_slots: int
    pages_per_slot: int

    def build(self, device) -> tuple[PageArena, "SlotCarver"]:
        """A zeroed arena of this shape on ``device`` and the carver of its slots."""
        arena = PageArena(self.num_pages, self.page_bytes, device, self.spare_pages)
        return arena, arena.carver(self.num_slots, self.pages_per_slot)


class SlotCarver:
    """Hands out a bank's slot tensors one after another, each at the next aligned offset of
    every slot's run of pages (a callable for ``SlotTensors(alloc=...)``)."""

    def __init__(self, arena: PageArena, num_slots: int, pages_per_slot: int, first_page: int):
        self.arena, self.num_slots = arena, num_slots
        self.pages_per_slot, self.first_page = pages_per_slot, first_page
        self.slot_stride = pages_per_slot * arena.page_bytes  # bytes
        self.used = 0  # bytes of each slot's run handed out so far

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed ``[S, *shape[1:]]`` tensor whose slot ``s`` lies in slot ``s``'s pages."""
        if shape[0] != self.num_slots:
            raise ValueError(f"a slot tensor of shape {tuple(shape)} for {self.num_slots} slots")
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_slot = math.prod(shape[1:]) * itemsize
        offset = -(-self.used // ALIGN) * ALIGN
        if offset + per_slot > self.slot_stride:
            raise ValueError(f"slot tensors need more than the {self.slot_stride} bytes of a slot's "
                             f"{self.pages_per_slot} pages")
        self.used = offset + per_slot
        inner = [1] * len(shape)
        for d in range(len(shape) - 2, 0, -1):
            inner[d] = inner[d + 1] * shape[d + 1]
        start = self.first_page * self.arena.page_bytes + offset
        view = self.arena.data.view(dtype).as_strided(tuple(shape), (self.slot_stride // itemsize, *inner[1:]),
                                                     start // itemsize)
        view.zero_()
        return view
