"""One ledger for KV pages and adapter slots carved from the same pages (docs/sizing.md, one
arena; docs/design.md, Joint memory ledger): a slot is a fixed run of ledger pages, KV pages are taken lowest
first, a slot takes an adapter only while all its pages are free or its own, and KV growth
may evict idle adapters to take their pages. CPU, the residency engine's own API."""

import hashlib

import pytest
import torch
from test_residency import pinned  # noqa: F401  (the pinned adapters fixture)

from mlora.batch.adapters.residency import (
    AdmissionError,
    HostArtifact,
    HostCache,
    KVCapacity,
    PagePool,
    Piece,
    Residency,
    ResidencyError,
    SlotStorage,
)

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
    from mlora.batch.adapters.residency import RequestAttempt

    res, A, _ = arena_residency()
    adm = res.admit("b", RequestAttempt("q1", 0), kv_pages=3)
    assert adm.kv_pages == (0, 1, 2) and res.catalog["b"].pages == [10, 11]
    check(res, A)


def test_taking_specific_pages_checks_they_are_free():
    from mlora.batch.adapters.residency import LedgerError, Owner

    pool = PagePool(6, 1)
    kv = pool.take(2, Owner.kv("r"))
    assert kv == [0, 1]
    assert pool.take(1, Owner.reserved("t"), specific=(4, 5)) == [2, 4, 5]  # the slot's pages plus the lowest free
    for bad in ((1,), (3, 3), (9,)):  # a KV page, twice the same page, no such page
        with pytest.raises(LedgerError):
            pool.take(0, Owner.reserved("u"), specific=bad)
    assert pool.free_pages() == [3] and pool.free_count == 1
    # pages taken by id and given back are free again exactly once; lowest-first stays exact
    pool.release([4, 5], Owner.reserved("t"))
    pool.release([2], Owner.reserved("t"))
    assert pool.free_pages() == [2, 3, 4, 5] and pool.free_count == 4
    assert pool.take(0, Owner.reserved("v"), specific=(5,)) == [5]
    assert pool.take(3, Owner.reserved("w")) == [2, 3, 4] and pool.free_count == 0
    pool.release([5], Owner.reserved("v"))
    assert pool.take(1, Owner.reserved("x")) == [5]
    pool.audit({Owner.kv("r"): [0, 1]}, {"w", "x"})


# ---- the bank's slots and the KV cache carved from one arena (arena.py) ------------------------

BLOCK = 16  # tokens per KV block: with the tiny model's 2 layers, 2 KV heads of 8, float32, a 4 KiB page


def arena_bank(slots: int, pages: int, backend: str = "auto"):
    from test_residency import LAYERS, rbank

    from mlora.batch.model.arena import PageArena
    from mlora.batch.model.kvcache import KVCache

    arena = PageArena(pages, 2 * LAYERS * BLOCK * 2 * 8 * 4, "cpu", spare_pages=1)
    bank = rbank(slots, arena=arena, backend=backend)
    kv = KVCache(LAYERS, pages + 1, BLOCK, 2, 8, torch.float32, "cpu", pages=arena.kv_pages(LAYERS, BLOCK, 2, 8,
                                                                                         torch.float32))
    return arena, bank, kv


def scribble(kv, blocks, value=float("nan")):
    """What a running sequence's cache writes do to these blocks: every byte of every layer."""
    for layer in range(kv.num_layers):
        kv.k[layer][blocks] = value
        kv.v[layer][blocks] = value


@pytest.mark.parametrize("backend", ["torch", "triton"])  # the Triton kernels take the arena's slot stride
def test_a_bank_over_an_arena_computes_what_its_own_slots_do(pinned, backend):
    """Slots carved from the arena's top pages: after the pages held other bytes (NaN, as KV
    blocks would leave them), loads write every element of the slots' views and the deltas
    equal a bank with its own tensors; KV writes to the pages below the slots change nothing."""
    from test_residency import _same, rbank

    arena, bank, kv = arena_bank(3, 40, backend)
    assert bank.backend == backend
    storage = bank.residency.storage
    first = storage.first_page
    assert first == 40 - 3 * storage.pages_per_slot and first > 0
    assert bank.A["qkv"].data_ptr() == arena.data[first * arena.page_bytes:].data_ptr()  # really in the arena
    arena.data.fill_(0xFF)  # every slot view NaN before its first load
    ref = rbank(3)
    _same(bank, ref, ["qv", "all", "pattern"], pinned, 0)
    scribble(kv, list(range(first)))  # the KV region, then the spare (scratch) page
    scribble(kv, [arena.num_pages])
    _same(bank, ref, ["qv", "all", "pattern"], pinned, 1)


def test_kv_growth_takes_an_idle_adapters_pages_and_it_comes_back(pinned):
    """Adapters in every slot, KV on every other page; growing the KV evicts the least recently
    used idle adapter and hands its slot's pages to the cache (whose writes land there); the
    others compute as before, and the evicted one loads again once the KV is released."""
    from test_residency import _same, rbank

    arena, bank, kv = arena_bank(2, 30)
    res, ref = bank.residency, rbank(2)
    first = res.storage.first_page
    _same(bank, ref, ["qv", "all"], pinned, 0)
    bank.ensure([], pinned)  # the invocation is over: its launch no longer holds the slots
    qv, al = (pinned[a].semantic_sha256 for a in ("qv", "all"))
    res.touch(al)  # qv is the least recently used
    assert res.reserve_kv("r1", first) == list(range(first))
    grown = res.grow_kv("r1", res.storage.pages_per_slot)
    qv_slot = res.storage.slot_pages(1)  # free slots go top first: qv (loaded first) took slot 1
    assert grown == qv_slot and qv not in res.catalog and al in res.catalog
    scribble(kv, grown)
    _same(bank, rbank(2), ["all"], pinned, 2)
    bank.ensure([], pinned)
    res.acquire("q", al)  # in use: not evictable, and qv's slot is KV now
    with pytest.raises(AdmissionError) as info:
        res.wait(res.begin(qv))
    assert info.value.reason == "adapter_slot_capacity"
    res.release_lease("q")
    res.release_kv("r1")
    res.audit()
    _same(bank, rbank(2), ["qv", "all"], pinned, 3)


def test_the_fused_gate_up_silu_launch_reads_arena_slots(pinned):
    """The gate/up expand fused into the SiLU product (``lora_silu_mul``, large invocations on a
    GPU) over slots carved from an arena: the numbers of a bank with its own tensors, its
    ``apply`` then the SiLU product (NaN on every page before the loads)."""
    from test_residency import SHAPES, rbank

    from mlora.kernels.elementwise import ElementwiseOps, silu_mul_ref

    arena, bank, _ = arena_bank(3, 40, "triton")
    arena.data.fill_(0xFF)
    bank.fuse_silu_min_rows = 1  # a 10-row invocation takes the fused launch
    ref = rbank(3, backend="torch")
    inter = SHAPES["gate_up"][1][0]
    g = torch.Generator().manual_seed(8)
    x = torch.randn(10, 32, generator=g)
    gu0 = torch.randn(10, 2 * inter, generator=g)
    ids = ["all", "pattern", "qv"]
    slots_ref, slots = ref.ensure(ids, pinned), bank.ensure(ids, pinned)
    pick = [0, -1, 1, 2, 2, 0, -1, 1, 0, 0]
    gu = gu0.clone()
    ref.context(torch.tensor([slots_ref[ids[i]] if i >= 0 else -1 for i in pick], dtype=torch.int32)).apply(
        0, "gate_up", x, gu)
    want = silu_mul_ref(gu, inter)
    assert not torch.equal(want, silu_mul_ref(gu0, inter))  # the adapter changes something
    gu = gu0.clone()
    got = bank.context(torch.tensor([slots[ids[i]] if i >= 0 else -1 for i in pick], dtype=torch.int32)).apply_silu_mul(
        0, x, gu, inter, ElementwiseOps(True))
    assert torch.equal(gu, gu0)  # the fused launch: the deltas never written into gate_up
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_take_kv_without_a_transaction_when_free_pages_suffice():
    """take_kv: the lowest free pages at once while they cover the request (no transaction id
    used), else reserve_kv's way (an idle adapter evicted); either way a KV record that
    grow_kv / release_kv and the audit see."""
    res, A, _ = arena_residency()
    for key in "ab":
        res.load(key)  # a in slot 3 (pages 10-11), b in slot 2 (8-9)
    before = next(res._txn_ids)
    assert res.take_kv("r1", 5) == [0, 1, 2, 3, 4] and next(res._txn_ids) == before + 1  # no transaction opened
    assert res.holds_kv("r1") and res.grow_kv("r1", 1) == [5]
    res.audit()
    with pytest.raises(ResidencyError, match="E_RESIDENCY_REQUEST_BOUND"):
        res.take_kv("r1", 1)  # already holds pages: the transaction path refuses it
    assert res.take_kv("r2", 4) == [6, 7, 10, 11] and "a" not in res.catalog  # short: a (LRU) evicted
    check(res, A)
    res.release_kv("r1")
    res.release_kv("r2")
    assert res.pool.counts()["kv"] == 0
    res.audit()
