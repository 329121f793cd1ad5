"""One ledger for KV pages and adapter slots carved from the same pages (docs/sizing.md, one
arena; spec 0x05C, 0x09J): a slot is a fixed run of ledger pages, KV pages are taken lowest
first, a slot takes an adapter only while all its pages are free or its own, and KV growth
may evict idle adapters to take their pages. CPU, the residency engine's own API."""

import hashlib

import pytest
import torch

from mlora.batch.residency import (AdmissionError, HostArtifact, HostCache, KVCapacity, PagePool, Piece,
                                   Residency, ResidencyError, SlotStorage)

SLOTS, PPS, PAGES = 4, 2, 12  # slot s holds pages FIRST + 2s, FIRST + 2s + 1
FIRST = PAGES - SLOTS * PPS


def arena_residency():
    """Four rank-2 slots of a 2x3 linear whose ledger pages are 4-11; pages 0-3 are KV only."""
    A = torch.zeros(SLOTS, 2, 3, dtype=torch.float64)
    B = torch.zeros(SLOTS, 2, 2, dtype=torch.float64)
    storage = SlotStorage({"A": (A, 0), "B": (B, 0)}, pages_per_slot=PPS, first_page=FIRST)
    host = HostCache()
    for k, key in enumerate("abcdex"):
        a = torch.full((2, 3), float(k + 1), dtype=torch.float64)
        b = torch.full((2, 2), float(-k - 1), dtype=torch.float64)
        digest = hashlib.sha256(key.encode()).hexdigest()
        host.put(HostArtifact(key, digest, [Piece("A", (), a), Piece("B", (), b)], pages=PPS))
    return Residency(storage, PagePool(PAGES, 1), host), A, B


def check(res, A):
    """Every published adapter sits on exactly its slot's pages, with its own bytes; the
    ledger proves conservation and single ownership."""
    for key, e in res.catalog.items():
        assert e.pages == res.storage.slot_pages(e.slot), (key, e.pages, e.slot)
        assert torch.equal(A[e.slot], torch.full((2, 3), float("abcdex".index(key) + 1), dtype=torch.float64))
    res.audit()


def test_slots_are_their_fixed_pages_top_first():
    res, A, _ = arena_residency()
    assert res.storage.slot_pages(0) == [4, 5] and res.storage.slot_pages(3) == [10, 11]
    for key in "abcd":
        res.load(key)
    # the top slot first: KV blocks, taken lowest page first, reach it last
    assert {k: e.slot for k, e in res.catalog.items()} == {"a": 3, "b": 2, "c": 1, "d": 0}
    check(res, A)


def test_adapters_then_kv_growth_evicts_idle_adapters_for_pages():
    """Fill every slot, then grow one request's KV past the free pages: the least recently used
    idle adapter is evicted and its slot's pages become KV; a later cold adapter takes the slot
    of another idle adapter (the KV-covered slot cannot take one)."""
    res, A, _ = arena_residency()
    for key in "abcd":
        res.load(key)
    assert res.reserve_kv("r1", 4) == [0, 1, 2, 3]
    grown = res.grow_kv("r1", 2)
    assert grown == [10, 11] and "a" not in res.catalog  # a (slot 3, least recently used) made room
    assert res.pool.owner(10).kind == "kv"
    check(res, A)
    with pytest.raises(ResidencyError, match="E_RESIDENCY_SLOT_BUSY"):
        res.wait(res.begin("e", slot=3))  # its pages are KV now
    res.load("e")
    assert res.catalog["e"].slot == 2 and "b" not in res.catalog  # b's slot, b being the LRU idle adapter
    check(res, A)
    # every adapter in use (a lease each): growth past the free pages is refused, nothing changed
    for i, key in enumerate("cde"):
        res.acquire(f"q{i}", key)
    with pytest.raises(KVCapacity):
        res.grow_kv("r1", 1)
    check(res, A)


def test_kv_then_a_cold_adapter_waits_for_pages():
    """KV blocks on every page: a cold adapter is refused (nothing evictable, no slot whose pages
    are free) without touching the ledger, and loads once the KV pages are released."""
    res, A, _ = arena_residency()
    res.reserve_kv("r1", PAGES)
    with pytest.raises(AdmissionError) as info:
        res.load("a")
    assert info.value.reason == "adapter_slot_capacity"
    assert res.pool.counts()["kv"] == PAGES and not res.catalog
    res.release_kv("r1")
    res.reserve_kv("r2", PAGES - PPS)  # pages 0-9: slots 0-2 covered, slot 3 free
    res.load("a")
    assert res.catalog["a"].slot == 3
    check(res, A)


def test_admission_with_kv_takes_the_slot_pages_and_lowest_kv_pages():
    """One admission of a cold adapter with KV pages: the adapter gets exactly its slot's pages,
    the request the lowest free ones."""
    from mlora.batch.residency import RequestAttempt

    res, A, _ = arena_residency()
    adm = res.admit("b", RequestAttempt("q1", 0), kv_pages=3)
    assert adm.kv_pages == (0, 1, 2) and res.catalog["b"].pages == [10, 11]
    check(res, A)


def test_taking_specific_pages_checks_they_are_free():
    from mlora.batch.residency import LedgerError, Owner

    pool = PagePool(6, 1)
    kv = pool.take(2, Owner.kv("r"))
    assert kv == [0, 1]
    assert pool.take(1, Owner.reserved("t"), specific=(4, 5)) == [2, 4, 5]  # the slot's pages plus the lowest free
    for bad in ((1,), (3, 3), (9,)):  # a KV page, twice the same page, no such page
        with pytest.raises(LedgerError):
            pool.take(0, Owner.reserved("u"), specific=bad)
    assert pool.free_pages() == [3]
