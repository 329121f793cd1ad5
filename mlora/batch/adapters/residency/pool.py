"""The joint page ledger (docs/design.md, Page ledger): one pool that adapter pages,
initial KV pages and the decode-growth reserve are all drawn from.

Owns the physical state of every page -- free, ``reserved(txn)`` or
``owned(object, generation)`` -- with exact integer accounting, and the audit
that proves conservation and single ownership. Must not know why a page is
taken: the residency manager decides owners, victims and rollback.

Invariant::

    P_total = P_free + P_reserved + P_adapter + P_KV        bytes = pages * page_bytes

Every page is in exactly one state (one owner slot per page); a move checks
the page's current owner first, so a double grant or a release by a
non-owner raises instead of corrupting the ledger. Free pages are handed out
lowest id first, so allocation is deterministic.

Three uses, one class: in the sixteen-slot fixture (tests/test_residency.py) the pages are the adapter
and KV storage themselves (``storage.PagedStorage``); in the GPU slot bank a
page is a budget token of ``page_bytes`` (adapter factors live in slot
tensors, KV in the KV cache); with ``--memory-ledger joint`` the pages are one
arena's (``mlora/batch/model/arena.py``): KV blocks, and slots on fixed runs of pages taken by id
(``take(specific=...)``).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from mlora.batch.adapters.residency.errors import LedgerError


@dataclass(frozen=True)
class Owner:
    kind: str  # "reserved" (by a transaction) | "adapter" | "kv"
    name: str  # transaction id, adapter key or request attempt id
    generation: int = 0  # adapter generation; 0 otherwise

    @staticmethod
    def reserved(txn: str) -> "Owner":
        return Owner("reserved", txn)

    @staticmethod
    def adapter(key: str, generation: int) -> "Owner":
        return Owner("adapter", key, generation)

    @staticmethod
    def kv(attempt: str) -> "Owner":
        return Owner("kv", attempt)

    def __str__(self) -> str:
        if self.kind == "adapter":
            return f"adapter {self.name}@g{self.generation}"
        return f"{self.kind} {self.name}"


KINDS = ("reserved", "adapter", "kv")


class PagePool:
    def __init__(self, num_pages: int, page_bytes: int):
        if num_pages < 0 or page_bytes < 1:
            raise ValueError(f"a page pool needs num_pages >= 0 and page_bytes >= 1, got {num_pages}, {page_bytes}")
        self.num_pages, self.page_bytes = int(num_pages), int(page_bytes)
        self._owner: list[Owner | None] = [None] * self.num_pages
        self._free = list(range(self.num_pages))  # a heap: the free pages, plus the stale entries of _gone
        self._gone: set[int] = set()  # taken by id (take(specific=...)) while still in the heap: skipped
        self._pages: dict[Owner, set[int]] = {}

    # ---- views -------------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def free_count(self) -> int:
        return len(self._free) - len(self._gone)

    @property
    def free_bytes(self) -> int:
        return self.free_count * self.page_bytes

    def owner(self, page: int) -> Owner | None:
        return self._owner[page]

    def pages_of(self, owner: Owner) -> list[int]:
        return sorted(self._pages.get(owner, ()))

    def owners(self) -> dict[Owner, list[int]]:
        return {o: sorted(p) for o, p in sorted(self._pages.items(), key=lambda kv: min(kv[1]))}

    def counts(self) -> dict[str, int]:
        out = {"free": self.free_count, **{k: 0 for k in KINDS}}
        for o, pages in self._pages.items():
            out[o.kind] += len(pages)
        return out

    def free_pages(self) -> list[int]:
        return sorted(p for p in self._free if p not in self._gone)

    def _pop_lowest(self) -> int:
        while True:
            p = heapq.heappop(self._free)
            if p in self._gone:  # a stale entry of a page taken by id
                self._gone.discard(p)
                continue
            return p

    # ---- moves (each checks current ownership first; all-or-nothing) ----------------

    def take(self, n: int, owner: Owner, victims: tuple[tuple[Owner, list[int]], ...] = (),
             specific: tuple[int, ...] = ()) -> list[int]:
        """Atomically give ``owner`` the free pages ``specific`` (a slot's fixed pages), the ``n``
        lowest other free pages and every page of ``victims`` (each page checked to belong to
        its victim owner). Returns the pages, sorted."""
        busy = [p for p in specific if not 0 <= p < self.num_pages or self._owner[p] is not None]
        if busy or len(set(specific)) != len(specific):
            raise LedgerError("E_LEDGER_OWNER_MISMATCH", f"pages {busy or list(specific)} are not all free")
        if n < 0 or n + len(specific) > self.free_count:
            raise LedgerError("E_LEDGER_CONSERVATION", f"cannot take {n} + {len(specific)} free pages, "
                              f"{self.free_count} free")
        for vo, vpages in victims:
            self._expect(vpages, vo)
        self._gone.update(specific)  # left in the heap, skipped when popped (no O(pages) rebuild per load)
        taken = list(specific) + [self._pop_lowest() for _ in range(n)]
        for vo, vpages in victims:
            self._unset(vpages, vo)
        pages = sorted(taken + [p for _, vp in victims for p in vp])
        self._set(pages, owner)
        return pages

    def move(self, pages: list[int], src: Owner, dst: Owner) -> None:
        """Hand ``pages`` from ``src`` to ``dst`` (e.g. reserved(tx7) -> adapter c@g1)."""
        self._expect(pages, src)
        self._unset(pages, src)
        self._set(pages, dst)

    def release(self, pages: list[int], owner: Owner) -> None:
        self._expect(pages, owner)
        self._unset(pages, owner)
        for p in pages:
            if p in self._gone:  # its stale heap entry is valid again
                self._gone.discard(p)
            else:
                heapq.heappush(self._free, p)

    def _expect(self, pages: list[int], owner: Owner) -> None:
        wrong = [p for p in pages if self._owner[p] != owner]
        if wrong or len(set(pages)) != len(pages):
            raise LedgerError("E_LEDGER_OWNER_MISMATCH", f"pages {wrong or pages} are not all owned by {owner} "
                              f"(owners: {[str(self._owner[p]) for p in wrong]})")

    def _unset(self, pages: list[int], owner: Owner) -> None:
        held = self._pages[owner]
        for p in pages:
            self._owner[p] = None
            held.discard(p)
        if not held:
            del self._pages[owner]

    def _set(self, pages: list[int], owner: Owner) -> None:
        for p in pages:
            self._owner[p] = owner
        self._pages.setdefault(owner, set()).update(pages)

    # ---- audit -------------------------------------------------------------------

    def audit(self, expected: dict[Owner, list[int]], open_txns: set[str]) -> dict[str, int]:
        """Prove conservation and ownership against what the manager believes: ``expected``
        maps every adapter and KV owner to its pages; reservations must belong to open
        transactions. Raises LedgerError naming the first broken invariant."""
        by_page: dict[Owner, set[int]] = {}
        free = set()
        for page, o in enumerate(self._owner):
            (free.add(page) if o is None else by_page.setdefault(o, set()).add(page))
        listed = [p for p in self._free if p not in self._gone]
        if free != set(listed) or len(listed) != len(free) or not self._gone <= set(self._free) \
                or by_page != self._pages:
            raise LedgerError("E_LEDGER_CONSERVATION", "the free list or owner index disagrees with page states")
        counts = self.counts()
        if sum(counts.values()) != self.num_pages:
            raise LedgerError("E_LEDGER_CONSERVATION", f"{counts} does not sum to {self.num_pages} pages")
        leaked = sorted(o.name for o in by_page if o.kind == "reserved" and o.name not in open_txns)
        if leaked:
            raise LedgerError("E_LEDGER_LEAKED_RESERVATION", f"pages reserved by closed transaction(s) {leaked}: "
                              "a failed or finished attempt did not close its reservation")
        owned = {o: pages for o, pages in by_page.items() if o.kind != "reserved"}
        want = {o: set(p) for o, p in expected.items() if p}
        if owned != want:
            diff = sorted(str(o) for o in set(owned) | set(want) if owned.get(o) != want.get(o))
            raise LedgerError("E_LEDGER_OWNER_MISMATCH", f"page owners disagree with residency/KV records for {diff}: "
                              "an owner is attached without its pages, or pages without their owner")
        return counts
