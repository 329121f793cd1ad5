"""The prefix cache's block index: full KV blocks addressed by content, shared read-only.

:class:`PrefixCache` wraps a :class:`~mlora.batch.model.kvcache.BlockAllocator`
and offers its interface (``allocate``, ``free``, ``num_free``, ``has``) plus
``match`` and ``publish`` (docs/design.md, Prefix identity). Every block is in
exactly one state:

* free: in the allocator;
* referenced: held by one or more rows (``refs >= 1``), published or not;
* cached: published, held by no row, evictable: first the blocks no row ever
  matched (a row's own question or generated tokens, likely never asked for
  again), least recently released first, then the matched ones (shared
  prefixes, which rows still waiting are likely to ask for), likewise.

A published block is never written again (a row writes only its own last,
partial block; the full blocks it publishes are read-only from then on), so a
row that matches a chain reads those blocks and computes only the rest.
Cached blocks count as free: ``allocate`` evicts them, in that order, before it
reports the cache full, so an idle cached prefix never preempts a running row.
Knows no tensors: block ids and key strings only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from mlora.batch.model.kvcache import BlockAllocator, KVCacheFull


@dataclass
class PrefixStats:
    """Job totals: blocks found by ``match``, blocks asked for, evictions, publications."""

    hit_blocks: int = 0
    looked_up_blocks: int = 0
    evictions: int = 0
    published: int = 0


class PrefixCache:
    """Content-addressed, reference-counted full KV blocks over ``allocator``."""

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self._block_of: dict[str, int] = {}
        self._key_of: dict[int, str] = {}
        self._refs: dict[int, int] = {}
        # published, unreferenced, oldest release first: never matched (evicted first), matched
        self._cold: OrderedDict[int, None] = OrderedDict()
        self._hot: OrderedDict[int, None] = OrderedDict()
        self._matched: set[int] = set()  # published blocks some row matched since they were published
        self._shared = 0  # published blocks with more than one reference
        self.stats = PrefixStats()

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out: the allocator's free ones and the evictable cached ones."""
        return self.allocator.num_free + len(self._cold) + len(self._hot)

    @property
    def num_cached(self) -> int:
        return len(self._cold) + len(self._hot)

    @property
    def num_shared(self) -> int:
        """Published blocks held by more than one row."""
        return self._shared

    def has(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int, owner=None) -> list[int]:
        """``n`` private blocks (one reference each), evicting cached blocks oldest first when the
        allocator runs short. All or nothing: raises KVCacheFull having taken none."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise KVCacheFull(n, self.num_free)
        short = n - self.allocator.num_free
        for _ in range(max(0, short)):
            self._evict_oldest()
        blocks = self.allocator.allocate(n, owner)
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def _evict_oldest(self) -> None:
        block, _ = (self._cold or self._hot).popitem(last=False)
        self._matched.discard(block)
        del self._block_of[self._key_of.pop(block)]
        self.allocator.free([block])
        self.stats.evictions += 1

    def cached_run(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` :meth:`match` would find now (no reference taken, nothing counted)."""
        seen: set[int] = set()
        for n, key in enumerate(keys):
            block = self._block_of.get(key)
            if block is None or block in seen:
                return n
            seen.add(block)
        return len(keys)

    def match(self, keys: Sequence[str], limit: int | None = None) -> list[int]:
        """The blocks of the longest leading run of ``keys`` that is cached or referenced (at most
        ``limit``), each with one more reference taken for the caller. A row holds a block once: the run
        also ends at a key naming a block already in it (key chains never repeat one)."""
        wanted = list(keys)[:limit] if limit is not None else list(keys)
        blocks: list[int] = []
        seen: set[int] = set()
        for key in wanted:
            block = self._block_of.get(key)
            if block is None or block in seen:
                break
            blocks.append(block)
            seen.add(block)
        for b in blocks:
            self._take(b)
        self.stats.looked_up_blocks += len(wanted)
        self.stats.hit_blocks += len(blocks)
        return blocks

    def unmatch(self, blocks: Sequence[int], looked_up: int) -> None:
        """Give back what :meth:`match` returned for ``looked_up`` keys, unused (the row was not
        admitted): its references dropped and the lookup not counted."""
        self.free(blocks)
        self.stats.looked_up_blocks -= looked_up
        self.stats.hit_blocks -= len(blocks)

    def _take(self, block: int) -> None:
        refs = self._refs.get(block, 0)
        self._matched.add(block)
        if refs == 0:
            (self._hot if block in self._hot else self._cold).pop(block)
        elif refs == 1:  # matched blocks are published: a second holder shares it
            self._shared += 1
        self._refs[block] = refs + 1

    def publish(self, key: str, block: int) -> bool:
        """Record that the referenced ``block`` holds the full block named ``key``; from now on it is
        read-only. False (nothing recorded) when ``key`` already names another block or ``block`` is
        published under another key: the caller keeps its private block."""
        if self._refs.get(block, 0) < 1:
            raise ValueError(f"block {block} is not held by any row: only a row's own computed block is published")
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        self.stats.published += 1
        return True

    def is_published(self, block: int) -> bool:
        """Whether ``block`` is read-only (a cached prefix block)."""
        return block in self._key_of

    def free(self, blocks: Sequence[int], owner=None) -> None:
        """Drop one reference of each block: a private block goes back to the allocator, a published
        one becomes cached (the most recently released, evicted last)."""
        blocks = list(blocks)
        bad = [b for b in blocks if self._refs.get(b, 0) < 1]
        if bad or len(set(blocks)) != len(blocks):
            raise ValueError(f"freeing blocks no row holds (double free or foreign id): {bad or blocks}")
        private = []
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 1 and b in self._key_of:
                self._shared -= 1
            if self._refs[b] == 0:
                del self._refs[b]
                if b in self._key_of:
                    (self._hot if b in self._matched else self._cold)[b] = None
                else:
                    private.append(b)
        if private:
            self.allocator.free(private, owner)
