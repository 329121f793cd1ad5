"""The residency engine (docs/design.md, Residency states to Page ledger).

Each fixture of the specification is replayed exactly, then mutated one field at a time;
every mutation must fail closed with its code. The CPU is the "device": copies
are synchronous and the fault injector stands in for slow or failing transfers.
"""

import dataclasses
import hashlib
import itertools
import random

import pytest
import torch
from factory import make_adapter, save_base, tiny_model

from mlora.batch.adapters.catalog import AdapterError, load_catalog, load_factors
from mlora.batch.adapters.residency import (
    TRANSITIONS,
    AdapterLoadError,
    AdmissionError,
    ArtifactRefused,
    FaultInjector,
    HostArtifact,
    HostCache,
    KVCapacity,
    LedgerError,
    LoadError,
    ManualEvent,
    NotEvictable,
    Owner,
    PagedStorage,
    PagePool,
    Piece,
    RequestAttempt,
    Residency,
    ResidencyBank,
    ResidencyError,
    RollbackError,
    SlotStorage,
    State,
    TransitionError,
    ValidationError,
    check_transition,
)
from mlora.batch.adapters.slots import SlotBank
from mlora.batch.errors import CodedError
from mlora.batch.model.lora import GROUPS, ROLE_SLICE, group_shapes, held_slices
from mlora.kernels import pitched_view

# ---- the sixteen-slot fixture (docs/design.md, Page ledger) --------------------------------

H, LAYERS, ELEM = 8, 2, 2  # hidden width, layers, bytes per element (binary16)
SLOT_BYTES = 2 * LAYERS * H * ELEM  # paired S-LoRA slot: 64 bytes
RANK_C = 1


def page_artifact(key: str, pages: int, seed: int) -> HostArtifact:
    """``pages`` vector pages of non-zero binary16 values (an adapter in the paired-slot layout)."""
    g = torch.Generator().manual_seed(seed)
    rows = (torch.rand(pages, 2 * LAYERS * H, generator=g) + 0.5).to(torch.float16)
    digest = hashlib.sha256(rows.numpy().tobytes()).hexdigest()
    return HostArtifact(key, digest, [Piece(str(i), (), rows[i]) for i in range(pages)], pages=pages)


def paged(num_pages: int, arts: dict[str, int], **kw):
    """A Residency over ``num_pages`` real vector pages, with host artifacts of the given page counts."""
    pool = PagePool(num_pages, SLOT_BYTES)
    storage = PagedStorage(num_pages, 2 * LAYERS * H, torch.float16, num_slots=8)
    host = HostCache()
    for seed, (key, pages) in enumerate(arts.items()):
        host.put(page_artifact(key, pages, seed))
    kw.setdefault("faults", FaultInjector())
    return Residency(storage, pool, host, trace=True, **kw)


def fixture16(**kw) -> Residency:
    """The fixture's initial ownership: r0 KV 0..3 (active, pinned), a 4..7 (refcount 1, pin 1),
    b 8..11 (idle, unpinned, host-backed, generation 4), 12..15 free."""
    res = paged(16, {"a": 4, "b": 4, "c": 4 * RANK_C}, max_load_attempts=1, **kw)
    assert res.reserve_kv("r0", 4) == [0, 1, 2, 3]
    res.load("a")
    res.acquire("ra#1", "a")
    res.pin("a")
    res.wait(res.begin("b", generation=4))
    res.acquire("rb#1", "b")
    res.release_lease("rb#1")
    res.trace.clear()
    return res


INITIAL = {Owner.kv("r0"): [0, 1, 2, 3], Owner.adapter("a", 1): [4, 5, 6, 7], Owner.adapter("b", 4): [8, 9, 10, 11]}


def page_bytes(res: Residency, pages) -> bytes:
    return res.storage.data[list(pages)].numpy().tobytes()


def art_bytes(res: Residency, key: str) -> bytes:
    art = res.host.get(res.host.digest_of(key))
    return torch.stack([p.src for p in art.pieces]).numpy().tobytes()


def test_fixture16_geometry_and_joint_demand():
    res = fixture16()
    assert SLOT_BYTES == 64 and res.pool.total_bytes == 1024 and res.storage.page_bytes == 64
    assert res.pool.owners() == INITIAL and res.pool.free_pages() == [12, 13, 14, 15]
    assert res.entry("a").state is State.ACTIVE and res.entry("b").state is State.IDLE
    ok, reason, d = res.can_admit("c", kv_pages=2, growth_pages=2)
    assert (ok, reason) == (True, "ok")
    assert (d.adapter, d.kv_initial, d.kv_growth, d.total) == (4 * RANK_C, 2, 2, 8)
    assert (d.bytes(d.adapter), d.bytes(d.kv_initial), d.bytes(d.kv_growth), d.bytes(d.total)) == (256, 128, 128, 512)
    assert (d.free, d.reclaimable, d.available) == (4, 4, 8)
    assert (d.bytes(d.free), d.bytes(d.reclaimable), d.bytes(d.available)) == (256, 256, 512)
    # b is the only legal victim; a fails the pin/reference predicate (r0's KV is never an adapter victim)
    assert res.ineligible(res.entry("b")) == []
    assert {"refcount", "pin_count"} <= set(res.ineligible(res.entry("a")))


def test_fixture16_successful_transaction_exactly():
    res = fixture16()
    held = res.faults.hold("copy", adapter="c")
    txn = res.begin("c", request="r1#1", kv_pages=2, growth_pages=2, txn_id="tx7")
    # mid-transaction: b retiring and unpublished, slots 8..15 reserved by tx7, c invisible
    assert res.pool.pages_of(Owner.reserved("tx7")) == list(range(8, 16))
    assert res.pool.counts() == {"free": 0, "reserved": 8, "adapter": 4, "kv": 4}
    assert [e.state for e in res.entries() if e.key == "b"] == [State.RETIRING]
    assert res.resolve("b") is None and res.resolve("c") is None and txn.entry.state is State.LOADING
    with pytest.raises(ResidencyError) as e:  # publication before the copy-complete event
        res.publish(txn)
    assert e.value.code == "E_RESIDENCY_PUBLISH_BEFORE_COPY" and txn.entry.state is State.LOADING
    assert res.poll(txn) is False
    held.complete()
    adm = res.wait(txn)
    assert (adm.handle.key, adm.handle.generation, adm.handle.pages) == ("c", 1, (8, 9, 10, 11))
    assert adm.kv_pages == (12, 13, 14, 15) and adm.request == "r1#1"
    c = res.entry("c")
    assert c.state is State.ACTIVE and c.refcount == 1 and res.lease("r1#1") == adm.handle
    assert ("b", 4) in res.tombstones and res.resolve("b") is None
    assert res.pool.owners() == {Owner.kv("r0"): [0, 1, 2, 3], Owner.adapter("a", 1): [4, 5, 6, 7],
                                 Owner.adapter("c", 1): [8, 9, 10, 11], Owner.kv("r1#1"): [12, 13, 14, 15]}
    assert res.audit() == {"free": 0, "reserved": 0, "adapter": 8, "kv": 8}  # KV r0 4 + a 4 + c 4 + KV r1 4 = 16
    assert page_bytes(res, [8, 9, 10, 11]) == art_bytes(res, "c")
    assert res.trace == [
        "validate-identity c",
        "demand c adapter=4 kv=2 growth=2 total=8",
        "retire b@g4",
        "reserve tx7 [8, 9, 10, 11, 12, 13, 14, 15]",
        "copy c@g1 -> [8, 9, 10, 11]",
        "copy-complete c@g1",
        "validate c@g1",
        "publish c@g1 slot 2 pages [8, 9, 10, 11]",
        "lease c@g1 r1#1",
        "commit-kv r1#1 [12, 13, 14, 15]",
        "tombstone b@g4",
    ]


ROLLBACK_TRACE = [
    "cancel-events tx7",
    "drop c@g1",
    "release-kv r1#1",
    "restore b@g5 -> [8, 9, 10, 11]",
    "copy b@g5 -> [8, 9, 10, 11]",
    "validate b@g5",
    "publish b@g5 slot 1 pages [8, 9, 10, 11]",
    "tombstone b@g4",
    "free tx7 [12, 13, 14, 15]",
]


def _assert_rolled_back(res: Residency, a_handle, b_bytes):
    """After rollback: r0 and a unchanged, b@g5 resident again, c absent, r1 not admitted."""
    assert res.pool.pages_of(Owner.kv("r0")) == [0, 1, 2, 3]
    assert res.resolve("a") == a_handle and res.entry("a").refcount == 1 and res.entry("a").pin_count == 1
    b = res.resolve("b")
    assert (b.generation, b.pages) == (5, (8, 9, 10, 11)) and res.entry("b").state is State.PUBLISHED
    assert page_bytes(res, [8, 9, 10, 11]) == b_bytes
    assert res.resolve("c") is None and all(e.key != "c" for e in res.entries())
    assert res.kv_pages("r1#1") == [] and res.open_transactions() == []
    with pytest.raises(ResidencyError):
        res.lease("r1#1")
    assert res.pool.free_pages() == [12, 13, 14, 15]
    assert res.audit() == {"free": 4, "reserved": 0, "adapter": 8, "kv": 4}  # conservation: 16 slots


def test_fixture16_copy_failure_rollback_exactly():
    res = fixture16()
    a_handle, b_handle, b_bytes = res.resolve("a"), res.resolve("b"), page_bytes(res, [8, 9, 10, 11])
    res.faults.fail("copy", adapter="c", attempt=1)  # after slots 8..11 were zeroed and partly overwritten
    with pytest.raises(LoadError) as e:
        res.begin("c", request="r1#1", kv_pages=2, growth_pages=2, txn_id="tx7")
    assert e.value.code == "E_RESIDENCY_COPY" and e.value.txn == "tx7"
    assert res.trace[:6] == ["validate-identity c", "demand c adapter=4 kv=2 growth=2 total=8", "retire b@g4",
                             "reserve tx7 [8, 9, 10, 11, 12, 13, 14, 15]", "copy c@g1 -> [8, 9, 10, 11]",
                             "fail tx7 E_RESIDENCY_COPY"]
    assert res.trace[6:] == ROLLBACK_TRACE
    _assert_rolled_back(res, a_handle, b_bytes)
    assert not res.is_current(b_handle)  # b@g4's handle is a tombstone, never valid again
    with pytest.raises(ResidencyError) as e:
        res.launch([b_handle])
    assert e.value.code == "E_RESIDENCY_STALE_GENERATION"


def test_fixture16_digest_failure_rollback():
    res = fixture16()
    a_handle, b_bytes = res.resolve("a"), page_bytes(res, [8, 9, 10, 11])
    res.faults.corrupt(adapter="c", where="value")
    txn = res.begin("c", request="r1#1", kv_pages=2, growth_pages=2, txn_id="tx7")
    with pytest.raises(ValidationError) as e:
        res.wait(txn)
    assert e.value.code == "E_VALIDATE_DIGEST"
    assert res.trace[res.trace.index("fail tx7 E_VALIDATE_DIGEST") + 1:] == ROLLBACK_TRACE
    _assert_rolled_back(res, a_handle, b_bytes)


# ---- one-field mutations: eligibility (docs/design.md, Eviction eligibility) -------------------


def _b(res):
    return res.entry("b")


MUTATIONS = {
    "state": lambda res: setattr(_b(res), "state", State.ACTIVE),
    "refcount": lambda res: setattr(_b(res), "refcount", 1),
    "pin_count": lambda res: setattr(_b(res), "pin_count", 1),
    "queued_reservations": lambda res: setattr(_b(res), "queued_reservations", 1),
    "inflight_events": lambda res: _b(res).events.append(ManualEvent()),
    "live_launch": lambda res: res.launch([res.resolve("b")]),
    "host_source": lambda res: res.host.forget(_b(res).digest),
}


@pytest.mark.parametrize("clause", list(MUTATIONS))
def test_victim_mutation_fails_closed(clause):
    res = fixture16()
    MUTATIONS[clause](res)
    assert res.ineligible(_b(res)) == [clause]
    with pytest.raises(NotEvictable) as e:
        res.evict("b")
    assert e.value.code == "E_RESIDENCY_NOT_EVICTABLE" and e.value.reasons == [clause]
    ok, reason, d = res.can_admit("c", kv_pages=2, growth_pages=2)
    assert (ok, reason, d.reclaimable) == (False, "joint_adapter_kv_capacity", 0)
    with pytest.raises(AdmissionError) as e:
        res.begin("c", request="r1#1", kv_pages=2, growth_pages=2, txn_id="tx7")
    assert e.value.code == "E_ADMISSION_CAPACITY" and e.value.reason == "joint_adapter_kv_capacity"
    assert e.value.demand.total == 8 and e.value.demand.free == 4
    # nothing changed: no victim retired, no page reserved, b still bound to its generation
    assert res.pool.owners() == INITIAL and _b(res).generation == 4 and res.open_transactions() == []
    assert not any(line.startswith(("retire", "reserve")) for line in res.trace)
    if clause not in ("state", "host_source"):
        res.audit()


def test_api_level_references_block_eviction():
    """The same clauses reached through the API rather than by setting fields."""
    res = fixture16()
    res.acquire("q#1", "b")  # a lease: b becomes active with refcount 1
    assert res.ineligible(_b(res)) == ["state", "refcount"]
    res.release_lease("q#1")
    assert _b(res).state is State.IDLE and res.ineligible(_b(res)) == []
    res.reserve_queued("b")  # a queued request's admission assumes b stays resident
    with pytest.raises(NotEvictable) as e:
        res.evict("b")
    assert e.value.reasons == ["queued_reservations"]
    res.release_queued("b")
    launch = res.launch([res.resolve("b")])  # a live launch snapshot names b@g4
    assert res.ineligible(_b(res)) == ["live_launch"]
    kernel = ManualEvent()
    launch.finish(kernel)  # issued, still running: the event guards the pages
    assert res.ineligible(_b(res)) == ["inflight_events", "live_launch"]
    kernel.complete()
    res.evict("b")
    assert res.resolve("b") is None and res.pool.free_pages() == [8, 9, 10, 11, 12, 13, 14, 15]
    res.audit()


def test_victim_ranking_is_lru_among_eligible_only():
    res = paged(12, {"x": 4, "y": 4, "z": 4, "w": 4})
    for k in "xyz":
        res.load(k)
    res.touch("x")  # y is now the least recently used, then z, then x
    res.pin("y")  # ... but pinned: ranking never sees it
    res.load("w")
    assert res.resolve("z") is None and res.resolve("y") is not None and res.resolve("x") is not None
    assert ("z", 1) in res.tombstones
    res.audit()


def test_victims_that_queued_work_still_needs_go_last():
    res = paged(12, {"x": 4, "y": 4, "z": 4, "w": 4, "v": 4})
    for k in "xyz":
        res.load(k)  # x is the least recently used
    res.wanted = frozenset({"x", "z"})  # waiting rows still name x and z
    res.load("w")
    assert res.resolve("y") is None and res.resolve("x") is not None  # y: not wanted, so first despite LRU x
    res.wanted = frozenset({"x", "z", "w"})  # every resident adapter wanted: plain LRU among them
    res.load("v")
    assert res.resolve("x") is None and res.resolve("z") is not None and res.resolve("w") is not None
    res.pin("z")
    res.wanted = frozenset()
    assert [e.key for e in res._eligible(set())] == ["w", "v"]  # the hint never makes a pinned slot eligible
    res.audit()


# ---- one-field mutations: publication, generations, rollback, ledger ---------------------------


def test_publish_before_validation_is_an_illegal_transition():
    res = fixture16()
    txn = res.begin("c")  # copy complete on the CPU, not yet validated
    with pytest.raises(TransitionError) as e:
        res.publish(txn)
    assert e.value.code == "E_RESIDENCY_TRANSITION"
    assert (e.value.from_state, e.value.to_state) == (State.LOADING, State.PUBLISHED)
    assert "loading -> published" in str(e.value)
    res.wait(txn)
    assert res.resolve("c").generation == 1


@pytest.mark.parametrize("field", ["slot_id", "slot_generation", "pointer_generation", "artifact_digest"])
def test_stale_handle_at_launch(field):
    res = fixture16()
    h = res.resolve("a")
    res.launch([h]).finish()
    bad = dataclasses.replace(h, **{field: (h.slot_id + 1 if field == "slot_id" else
                                            "0" * 64 if field == "artifact_digest" else getattr(h, field) - 1)})
    with pytest.raises(ResidencyError) as e:
        res.launch([h, bad])
    assert e.value.code == "E_RESIDENCY_STALE_GENERATION"


def test_missing_host_source_during_rollback_fails_closed():
    res = fixture16()
    a_handle = res.resolve("a")
    held = res.faults.hold("copy", adapter="c")
    res.faults.fail("validate", adapter="c")
    txn = res.begin("c", request="r1#1", kv_pages=2, growth_pages=2, txn_id="tx7")
    res.host.forget([e for e in res.entries() if e.key == "b"][0].digest)  # the trusted copy of b disappears
    held.complete()
    with pytest.raises(RollbackError) as e:
        res.wait(txn)
    assert e.value.code == "E_RESIDENCY_NO_HOST_SOURCE" and e.value.__cause__.code == "E_VALIDATE_DIGEST"
    # every ownership closed: b could not come back (absent), its pages are free, the pool conserved
    assert res.resolve("b") is None and all(e.key not in ("b", "c") for e in res.entries())
    assert res.resolve("a") == a_handle and res.kv_pages("r1#1") == []
    assert res.pool.free_pages() == list(range(8, 16)) and res.open_transactions() == []
    assert res.audit() == {"free": 8, "reserved": 0, "adapter": 4, "kv": 4}


def test_leaked_reservation_is_found_by_the_audit():
    res = fixture16()
    res.pool.take(1, Owner.reserved("tx99"))  # an attempt that never closed its reservation
    with pytest.raises(LedgerError) as e:
        res.audit()
    assert e.value.code == "E_LEDGER_LEAKED_RESERVATION" and "tx99" in str(e.value)


def test_released_bitmap_with_owner_attached_is_found_by_the_audit():
    res = fixture16()
    res.pool.release([4, 5, 6, 7], Owner.adapter("a", 1))  # pages freed, adapter a still resident
    with pytest.raises(LedgerError) as e:
        res.audit()
    assert e.value.code == "E_LEDGER_OWNER_MISMATCH"
    res = fixture16()
    res.pool.move([8], Owner.adapter("b", 4), Owner.kv("r0"))  # one page with two claimants
    with pytest.raises(LedgerError) as e:
        res.audit()
    assert e.value.code == "E_LEDGER_OWNER_MISMATCH"


def test_pool_refuses_double_grants():
    pool = PagePool(4, 64)
    pool.take(2, Owner.kv("r"))
    with pytest.raises(LedgerError) as e:
        pool.release([0, 1, 2], Owner.kv("r"))  # page 2 is free, not r's
    assert e.value.code == "E_LEDGER_OWNER_MISMATCH" and pool.counts() == {"free": 2, "reserved": 0, "adapter": 0, "kv": 2}
    with pytest.raises(LedgerError):
        pool.take(3, Owner.kv("s"))
    assert pool.free_pages() == [2, 3]


def test_transition_table_is_the_spec_chain_and_nothing_else():
    chain = [State.ABSENT, State.HOST_READY, State.RESERVED, State.LOADING, State.VALIDATED, State.PUBLISHED,
             State.ACTIVE, State.IDLE, State.RETIRING, State.ABSENT]
    for a, b in zip(chain, chain[1:]):
        check_transition("x", a, b)
    for a, b in itertools.product(State, State):
        if b in TRANSITIONS[a]:
            check_transition("x", a, b)
        else:
            with pytest.raises(TransitionError) as e:
                check_transition("x@g1", a, b)
            assert e.value.code == "E_RESIDENCY_TRANSITION" and f"{a.value} -> {b.value}" in str(e.value)
            assert isinstance(e.value, CodedError) and str(e.value) == f"{e.value.code}: {e.value.message}"
    # the safety edges the spec forbids
    for a, b in [(State.LOADING, State.PUBLISHED), (State.RETIRING, State.PUBLISHED), (State.ABSENT, State.PUBLISHED),
                 (State.RESERVED, State.VALIDATED), (State.PUBLISHED, State.ABSENT), (State.IDLE, State.ABSENT)]:
        assert b not in TRANSITIONS[a]


# ---- hotswap and leases (docs/design.md, Slot generation, Lease) ------------------------------

W = torch.tensor([[2.0, -1, 0], [1, 3, -2]], dtype=torch.float64)
X_OLD, X_NEW = torch.tensor([1.0, 2, -1], dtype=torch.float64), torch.tensor([2.0, 0, 1], dtype=torch.float64)


def tiny_slot_table(num_slots=10):
    """Rank-two physical slots of a 2x3 linear: A [S, 2, 3], B [S, 2, 2], scale [S]."""
    A = torch.zeros(num_slots, 2, 3, dtype=torch.float64)
    B = torch.zeros(num_slots, 2, 2, dtype=torch.float64)
    scale = torch.zeros(num_slots, dtype=torch.float64)
    storage = SlotStorage({"A": (A, 0), "B": (B, 0), "scale": (scale, 0)})
    return storage, A, B, scale


def lora_artifact(digest, a, b, s):
    r = len(a)
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    return HostArtifact("tenant-a", digest, [Piece("A", (slice(0, r),), t(a)), Piece("B", (slice(None), slice(0, r)), t(b)),
                                             Piece("scale", (), t(s))])


OLD = lambda: lora_artifact("old-digest", [[1, 4, 1], [-1, 2, 2]], [[1, 0], [0, 1]], 0.5)  # noqa: E731  Delta_o
NEW = lambda: lora_artifact("new-digest", [[2, -1, 0]], [[1], [3]], 0.25)  # noqa: E731  rank 1 in a rank-2 slot


def hotswap_fixture():
    storage, A, B, scale = tiny_slot_table()
    host = HostCache()
    host.put(OLD())
    res = Residency(storage, PagePool(10, 1), host, faults=FaultInjector())
    res.catalog_generation = 7
    res.seed_slot(7, 12, 30)
    res.seed_slot(8, 21, 40)
    A[8].fill_(7.0)  # stale bytes of some earlier occupant of slot 8: padding must not inherit them
    B[8].fill_(7.0)
    res.wait(res.begin("tenant-a", slot=7))

    def run(handle, x):
        s = handle.slot_id
        return (W @ x + scale[s] * (B[s] @ (A[s] @ x))).tolist()

    return res, run, A, B


def test_hotswap_publication_transaction_exactly():
    res, run, A, B = hotswap_fixture()
    old = res.acquire("request-old", "tenant-a")
    assert (res.catalog_generation, old.slot_id, old.slot_generation, old.pointer_generation, old.artifact_digest) == \
        (8, 7, 12, 31, "old-digest")
    assert res.entry("tenant-a").refcount == 1
    kernel = ManualEvent()
    res.launch([old]).finish(kernel)  # last-use event of slot 7: incomplete (a kernel in flight)
    new = res.replace(NEW(), slot=8)
    assert (res.catalog_generation, new.slot_id, new.slot_generation, new.pointer_generation, new.artifact_digest) == \
        (9, 8, 21, 41, "new-digest")
    assert res.resolve("tenant-a") == new and res.acquire("request-new", "tenant-a") == new
    assert torch.equal(A[8][1], torch.zeros(3, dtype=torch.float64)) and torch.equal(B[8][:, 1], torch.zeros(2, dtype=torch.float64))
    # leases are not re-resolved: each request keeps the generation it was admitted with
    assert res.lease("request-old") == old and res.is_current(old)
    assert run(res.lease("request-old"), X_OLD) == [4.0, 19 / 2]
    assert run(res.lease("request-new"), X_NEW) == [5.0, 3.0]
    states = {(e.slot, e.state) for e in res.entries()}
    assert states == {(7, State.RETIRING), (8, State.ACTIVE)}
    res.launch([old]).finish()  # the old request's next iteration still launches on its own handle


@pytest.mark.parametrize("order", ["release_then_event", "event_then_release"])
def test_retiring_slot_needs_refcount_zero_and_last_use_event(order):
    res, run, A, B = hotswap_fixture()
    old = res.acquire("request-old", "tenant-a")
    kernel = ManualEvent()
    res.launch([old]).finish(kernel)
    res.replace(NEW(), slot=8)
    first, second = ((lambda: res.release_lease("request-old"), kernel.complete) if order == "release_then_event"
                     else (kernel.complete, lambda: res.release_lease("request-old")))
    first()  # refcount alone, or the event alone, is not enough
    assert res.collect() == [] and res.is_current(old) and res.slots[7].slot_generation == 12
    second()
    res.collect()
    assert res.slots[7].entry is None and (res.slots[7].slot_generation, res.slots[7].pointer_generation) == (13, 32)
    with pytest.raises(ResidencyError) as e:  # a delayed stale handle never becomes valid again (ABA)
        res.launch([old])
    assert e.value.code == "E_RESIDENCY_STALE_GENERATION"
    res.host.put(dataclasses.replace(OLD(), key="tenant-b"))
    reused = res.wait(res.begin("tenant-b", slot=7)).handle
    assert (reused.slot_id, reused.slot_generation, reused.pointer_generation) == (7, 13, 33) and not res.is_current(old)
    res.audit()


def test_hotswap_copy_failure_leaves_catalog_and_output():
    res, run, A, B = hotswap_fixture()
    old = res.acquire("request-old", "tenant-a")
    res.faults.fail("copy", adapter="tenant-a", attempt=2)
    with pytest.raises(LoadError) as e:
        res.replace(NEW(), slot=8)
    assert e.value.code == "E_RESIDENCY_COPY"
    assert res.catalog_generation == 8 and res.resolve("tenant-a") == old and res.is_current(old)
    assert run(old, X_OLD) == [4.0, 19 / 2]
    s8 = res.slots[8]
    assert (s8.entry, s8.txn, s8.slot_generation, s8.pointer_generation) == (None, None, 22, 41)  # bumped, free
    res.audit()


# ---- retries -----------------------------------------------------------------------------------


def test_retry_gets_new_attempt_and_generation_and_keeps_arrival():
    res = paged(8, {"D": 3}, max_load_attempts=3)
    res.faults.fail("copy", adapter="D", attempt=1)
    d0 = RequestAttempt("d0", 1, arrival=0.0)
    adm = res.admit("D", d0)
    assert adm.attempts == ("d0#1", "d0#2") and adm.request == "d0#2"
    assert adm.handle.generation == 2 and res.lease("d0#2") == adm.handle
    assert [line for line in res.trace if line.startswith(("reserve", "free", "publish", "fail"))] == [
        "reserve tx1 [0, 1, 2]", "fail tx1 E_RESIDENCY_COPY", "free tx1 [0, 1, 2]",
        "reserve tx2 [0, 1, 2]", "publish D@g2 slot 0 pages [0, 1, 2]"]
    assert res.pool.free_count == 5
    res.finish_request("d0#2")
    res.evict("D")
    assert res.pool.free_count == 8 and res.audit()["free"] == 8
    assert d0.retry() == RequestAttempt("d0", 2, arrival=0.0) and d0.retry().retry().id == "d0#3"


def test_permanent_failure_ends_in_adapter_load_error():
    res = paged(8, {"D": 3, "E": 4}, max_load_attempts=3)
    res.load("E")
    res.faults.fail("validate", adapter="D", times=None)
    with pytest.raises(AdapterLoadError) as e:
        res.admit("D", RequestAttempt("d0"), kv_pages=2)  # 5 pages, 4 free: E is the victim
    assert e.value.code == "E_ADAPTER_LOAD" and e.value.attempts == ["d0#1", "d0#2", "d0#3"]
    assert isinstance(e.value, AdapterError) and e.value.last.code == "E_VALIDATE_DIGEST"
    assert res.resolve("D") is None and res.resolve("E").generation == 4  # E was a victim 3 times, restored 3 times
    assert res.stats.rollbacks == 3 and res.stats.restores == 3 and res.stats.load_failures == 3
    assert res.audit() == {"free": 4, "reserved": 0, "adapter": 4, "kv": 0}


# ---- residency and scheduling failure cases ---------------------------------------------------


def test_cancel_during_transfer_rolls_back():
    res = fixture16()
    a_handle, b_bytes = res.resolve("a"), page_bytes(res, [8, 9, 10, 11])
    res.faults.hold("copy", adapter="c")
    txn = res.begin("c", request="r1#1", kv_pages=2, growth_pages=2, txn_id="tx7")
    res.cancel(txn)  # waits for the transfer (it cannot be recalled), then compensates
    assert res.trace[res.trace.index("fail tx7 E_RESIDENCY_CANCELLED") + 1:] == ROLLBACK_TRACE
    _assert_rolled_back(res, a_handle, b_bytes)


def test_cancel_during_transfer_can_keep_the_load_as_prefetch():
    res = fixture16()
    held = res.faults.hold("copy", adapter="c")
    txn = res.begin("c", request="r1#1", kv_pages=2, growth_pages=2, txn_id="tx7")
    res.cancel(txn, keep_adapter=True)
    held.complete()
    adm = res.wait(txn)
    assert adm.request is None and adm.kv_pages == () and res.kv_pages("r1#1") == []
    c = res.entry("c")
    assert c.state is State.PUBLISHED and c.refcount == 0 and c.prefetched
    assert res.pool.free_pages() == [12, 13, 14, 15] and res.audit()["kv"] == 4
    res.acquire("r2#1", "c")
    assert res.stats.prefetch_used == 1


def test_slow_transfer_is_not_executable_until_published():
    res = fixture16()
    res.faults.delay("copy", adapter="c", polls=3)
    txn = res.begin("c")  # takes b's pages (b is the only legal victim)
    for _ in range(2):
        assert res.poll(txn) is False
        assert res.resolve("c") is None and txn.entry.state is State.LOADING
        with pytest.raises(ResidencyError) as e:  # a cold adapter is load-eligible, not executable
            res.acquire("r1#1", "c")
        assert e.value.code == "E_RESIDENCY_NOT_PUBLISHED"
        res.launch([res.resolve("a")]).finish()  # resident work keeps running meanwhile
    assert res.poll(txn) is True and res.resolve("c").generation == 1
    res.acquire("r1#1", "c")
    res.audit()


def test_one_load_of_a_key_at_a_time():
    res = fixture16()
    held = res.faults.hold("copy", adapter="c")
    txn = res.prefetch("c")
    with pytest.raises(ResidencyError) as e:  # a request for c waits for the load in flight
        res.begin("c", request="r1#1", kv_pages=2, growth_pages=2)
    assert e.value.code == "E_RESIDENCY_LOAD_IN_FLIGHT" and txn.id in str(e.value)
    held.complete()
    assert res.poll(txn)
    adm = res.admit("c", RequestAttempt("r1"), kv_pages=1)  # now a hit: no second copy
    assert adm.handle.generation == 1 and res.stats.load_attempts == 3 and res.stats.prefetch_used == 1


def test_slow_validation_result():
    res = fixture16()
    res.faults.delay("validate", adapter="c", polls=2)
    txn = res.begin("c")
    assert res.poll(txn) is False and res.resolve("c") is None
    assert res.poll(txn) is True and res.resolve("c") is not None


def test_adapters_then_kv_growth_never_overcommits():
    res = paged(8, {k: 2 for k in "pqrs"})
    for k in "pqrs":
        res.load(k)  # the pool is full of idle adapters
    assert res.pool.free_count == 0
    assert res.reserve_kv("req#1", 1, growth_pages=1) == [0, 1]  # p (least recently used) evicted
    assert res.resolve("p") is None
    assert res.grow_kv("req#1", 1) == [1]  # from its own growth reserve: nothing evicted
    assert res.grow_kv("req#1", 2) == [2, 3] and res.resolve("q") is None  # q evicted for two more pages
    res.acquire("u#1", "r")
    res.acquire("v#1", "s")  # the rest is in use
    with pytest.raises(KVCapacity) as e:
        res.grow_kv("req#1", 1)
    assert e.value.code == "E_KV_CAPACITY" and e.value.available == 0
    assert res.kv_pages("req#1") == [0, 1, 2, 3] and res.audit() == {"free": 0, "reserved": 0, "adapter": 4, "kv": 4}


def test_kv_then_cold_adapter_queues_instead_of_oom():
    res = paged(8, {"c": 4})
    res.reserve_kv("r0", 6)
    res.reserve_kv("r1", 2)
    ok, reason, d = res.can_admit("c")
    assert (ok, reason, d.total, d.available) == (False, "joint_adapter_kv_capacity", 4, 0)
    with pytest.raises(AdmissionError) as e:
        res.admit("c", RequestAttempt("q"), kv_pages=1)
    assert e.value.code == "E_ADMISSION_CAPACITY" and res.pool.counts()["kv"] == 8 and res.stats.load_attempts == 0
    res.finish_request("r0")
    adm = res.admit("c", RequestAttempt("q"), kv_pages=1)
    assert adm.handle.pages == (0, 1, 2, 3) and adm.kv_pages == (4,)
    assert res.audit() == {"free": 1, "reserved": 0, "adapter": 4, "kv": 3}


def test_prefetch_and_admission_draw_from_one_ledger():
    res = paged(8, {"c": 4, "d": 4, "e": 4})
    res.reserve_kv("r#1", 2, growth_pages=2)  # admitted KV with its decode-growth horizon
    assert res.poll(res.prefetch("c")) and res.resolve("c") is not None  # 4 free pages: fits
    assert res.stats.prefetches == 1
    txn = res.prefetch("d")  # only by evicting the idle prefetched c, never r's growth pages
    assert res.poll(txn) and res.resolve("c") is None and res.kv_pages("r#1") == [0, 1, 2, 3]
    res.acquire("x#1", "d")
    assert res.prefetch("e") is None and res.resolve("e") is None  # no reclaimable page: refused, nothing changed
    assert res.grow_kv("r#1", 2) == [2, 3]  # the growth reserve is still there
    assert res.audit() == {"free": 0, "reserved": 0, "adapter": 4, "kv": 4}


# ---- ResidencyBank over real PEFT adapters -----------------------------------------------------

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPES = group_shapes(hidden=32, intermediate=64, num_heads=4, num_kv_heads=2, head_dim=8)  # factory.tiny_config
ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8),
    "all": dict(r=8, lora_alpha=16, target_modules=ALL),
    "pattern": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "o_proj", "down_proj"],
                    rank_pattern={"o_proj": 2, "model.layers.1.self_attn.q_proj": 6}, alpha_pattern={"down_proj": 3}),
    "rslora": dict(r=2, lora_alpha=4, use_rslora=True, target_modules=["gate_proj", "up_proj"]),
    "kvup": dict(r=3, lora_alpha=-5, target_modules=["k_proj", "v_proj", "up_proj"]),
}


@pytest.fixture(scope="module")
def pinned(tmp_path_factory):
    root = tmp_path_factory.mktemp("residency")
    base = save_base(tiny_model("llama"), str(root / "base"))
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        make_adapter(str(root / "adapters" / name), seed=30 + i, lora_dropout=0.0, **kw)
    return load_catalog(str(root / "adapters"), None).pin(set(ADAPTERS), base, workers=2)


def rbank(slots=2, **kw):
    kw.setdefault("faults", FaultInjector())
    return ResidencyBank(LAYERS, SHAPES, slots, 8, torch.float32, "cpu", **kw)


def _apply_all(bank, slot_of, ids, gen):
    """Deltas of every (layer, group) for random rows over ``ids`` (and base rows)."""
    T, dev = 17, bank.device
    pick = torch.randint(-1, len(ids), (T,), generator=gen)
    pick[: len(ids)] = torch.arange(len(ids))
    ctx = bank.context(torch.tensor([slot_of[ids[i]] if i >= 0 else -1 for i in pick.tolist()], dtype=torch.int32))
    out = []
    for layer in range(LAYERS):
        for group in GROUPS:
            d_in, widths = SHAPES[group]
            x = torch.randn(T, d_in, generator=gen).to(dev)
            y = torch.randn(T, sum(widths), generator=gen).to(dev)
            ctx.apply(layer, group, x, y)
            out.append(y.cpu())
    return out


def _same(bank, ref, ids, pinned, seed, atol=1e-6):
    got = _apply_all(bank, bank.ensure(ids, pinned), ids, torch.Generator().manual_seed(seed))
    want = _apply_all(ref, ref.ensure(ids, pinned), ids, torch.Generator().manual_seed(seed))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=atol)


def test_two_slots_equal_five_slot_bank_across_evictions(pinned):
    bank, ref = rbank(2), SlotBank(LAYERS, SHAPES, 5, 8, torch.float32, "cpu")
    rng = random.Random(0)
    names = sorted(ADAPTERS)
    for step in range(14):
        ids = rng.sample(names, rng.choice([1, 2]))
        _same(bank, ref, ids, pinned, step)
        bank.residency.audit()
    assert bank.stats.evictions >= 5 and bank.stats.hits >= 1 and bank.stats.loads == bank.stats.misses
    assert bank.residency.state_counts()["published"] == 2
    assert bank.stats.h2d_bytes > 0 and all(s.txn is None for s in bank.residency.slots)


def test_bank_validation_failure_on_first_attempt_is_retried(pinned):
    bank, ref = rbank(2, trace=True), SlotBank(LAYERS, SHAPES, 5, 8, torch.float32, "cpu")
    bank.ensure(["qv", "pattern"], pinned)
    bank.residency.trace.clear()
    bank.residency.faults.corrupt(adapter="kvup", attempt=1, where="tail")  # a stale value in a padded A tail
    _same(bank, ref, ["kvup"], pinned, 1)
    trace = bank.residency.trace
    assert any(line.endswith("E_VALIDATE_TAIL") for line in trace)
    assert bank.stats.rollbacks == 1 and bank.stats.restores == 1 and bank.stats.load_failures == 1
    assert [line.split()[0] for line in trace if line.split()[0] in ("restore", "publish")] == \
        ["restore", "publish", "publish"]  # the victim came back, then attempt 2 published
    bank.residency.audit()


@pytest.mark.parametrize("point", ["copy", "validate"])
def test_bank_permanent_failure_leaves_the_bank_unchanged(pinned, point):
    bank = rbank(2)
    bank.ensure(["qv"], pinned)
    bank.ensure(["pattern"], pinned)
    before = bank.resident
    tensors = {(k, g): t.clone() for k, d in (("A", bank.A), ("B", bank.B), ("ranks", bank.ranks),
                                             ("scales", bank.scales)) for g, t in d.items()}
    bank.residency.faults.fail(point, adapter="all", times=None)
    with pytest.raises(AdapterLoadError) as e:
        bank.ensure(["all"], pinned)
    assert e.value.code == "E_ADAPTER_LOAD" and e.value.adapter_id == "all" and len(e.value.attempts) == 3
    assert bank.resident == before  # same adapters in the same slots, same LRU order
    for k, d in (("A", bank.A), ("B", bank.B), ("ranks", bank.ranks), ("scales", bank.scales)):
        for g in d:
            assert torch.equal(d[g], tensors[(k, g)])
    assert bank.residency.audit() == {"free": 0, "reserved": 0, "adapter": 2, "kv": 0}
    ref = SlotBank(LAYERS, SHAPES, 5, 8, torch.float32, "cpu")
    _same(bank, ref, ["qv", "pattern"], pinned, 3)  # restored generations serve exactly the old bytes


def test_bank_malformed_scaling_metadata_is_refused(pinned):
    bank = rbank(1)
    bank.ensure(["qv"], pinned)
    p = pinned["rslora"]
    bad = dataclasses.replace(p, semantic_sha256="f" * 64, modules=tuple(
        dataclasses.replace(m, scale=float("nan")) if i == 0 else m for i, m in enumerate(p.modules)))
    with pytest.raises(ArtifactRefused) as e:  # refused on the host, before any eviction, not retried
        bank.ensure(["rslora"], {"rslora": bad})
    assert e.value.code == "E_VALIDATE_SCALE" and e.value.adapter_id == "rslora" and bank.stats.load_attempts == 1
    assert isinstance(e.value, AdapterError)  # the engine fails that adapter's rows, the job goes on
    assert list(bank.resident) == [pinned["qv"].semantic_sha256]
    bank.residency.faults.corrupt(adapter="rslora", attempt=1, where="scale")  # corrupted in transit
    bank.residency.trace = []
    bank.ensure(["rslora"], pinned)  # refused at validation, rolled back (qv restored), retried
    fails = [line for line in bank.residency.trace if line.startswith("fail ")]
    assert len(fails) == 1 and fails[0].endswith("E_VALIDATE_SCALE") and bank.stats.load_failures == 1
    assert bank.residency.faults.log == [("copy", "corrupt", "rslora", 1)]
    assert list(bank.resident) == [pinned["rslora"].semantic_sha256]
    bank.residency.audit()


def test_bank_leases_protect_slots_between_iterations(pinned):
    bank = rbank(2)
    h = bank.acquire("req-1#1", "qv", pinned)
    bank.ensure(["all"], pinned)
    bank.ensure(["pattern"], pinned)  # all is evicted, never qv
    assert bank.residency.is_current(h) and pinned["all"].semantic_sha256 not in bank.resident
    with pytest.raises(AdmissionError) as e:
        bank.ensure(["all", "rslora"], pinned)  # two slots wanted, one is leased
    assert e.value.reason == "adapter_slot_capacity"
    bank.release("req-1#1")
    bank.ensure(["all", "rslora"], pinned)
    assert not bank.residency.is_current(h)
    bank.residency.audit()


def test_bank_open_launch_protects_its_slots(pinned):
    bank = rbank(2)
    slot_of = bank.ensure(["qv"], pinned)
    with pytest.raises(NotEvictable) as e:  # held by this invocation's plan
        bank.residency.evict(pinned["qv"].semantic_sha256)
    assert e.value.reasons == ["queued_reservations"]
    ctx = bank.context(torch.tensor([slot_of["qv"], -1], dtype=torch.int32))
    with pytest.raises(NotEvictable) as e:
        bank.residency.evict(pinned["qv"].semantic_sha256)
    assert e.value.reasons == ["live_launch"]
    ctx.close()
    bank.residency.evict(pinned["qv"].semantic_sha256)
    with pytest.raises(Exception) as e:
        bank.context(torch.tensor([slot_of["qv"]], dtype=torch.int32))
    assert e.value.code == "E_BANK_SLOT_EMPTY"


def test_bank_shares_a_joint_ledger_with_kv(pinned):
    slot_bytes = ResidencyBank.bytes_per_slot(LAYERS, SHAPES, 8, torch.float32)
    pool = PagePool(10, slot_bytes // 4)  # a KV-block-sized page: one adapter slot costs 4 pages
    bank = rbank(3, pool=pool)
    assert bank.residency.storage.pages_per_slot == 4
    bank.residency.reserve_kv("r#1", 4)
    bank.ensure(["qv"], pinned)
    with pytest.raises(AdmissionError) as e:  # 2 pages left: a second adapter does not fit next to the KV
        bank.ensure(["qv", "all"], pinned)
    assert e.value.reason == "joint_adapter_kv_capacity" and list(bank.resident) == [pinned["qv"].semantic_sha256]
    bank.residency.finish_request("r#1")
    bank.ensure(["qv", "all"], pinned)
    assert bank.residency.audit() == {"free": 2, "reserved": 0, "adapter": 8, "kv": 0}


def test_slot_factor_views_are_contiguous(pinned):
    """A slot's factors are one contiguous block per tensor (slot-major banks), so a load's
    whole-view copies are plain copies (no device temporary and scatter kernel), and the
    landed views hold exactly the adapter's factors at their layers."""
    bank = rbank(slots=3)
    slot = bank.ensure(["qv"], pinned)["qv"]
    views = bank.residency.storage.views(slot, [])
    for g in bank.groups:
        for name in (f"A.{g}", f"B.{g}", f"ranks.{g}", f"scales.{g}"):  # plain copies each way (load, read-back)
            assert views[name].is_contiguous() and views[name].data_ptr() != 0
        assert torch.equal(views[f"A.{g}"], bank.A[g][slot])
        assert torch.equal(views[f"B.{g}"], bank.B[g][slot].flatten(1))  # B: one flat run per layer (rank-pitched)
    factors = load_factors(pinned["qv"], torch.float32, "cpu")
    (layer, role), (fa, fb, _) = sorted(factors.items())[0]
    group, j = ROLE_SLICE[role]
    assert torch.equal(bank.A[group][:, layer][slot, j, : fa.shape[0]], fa)  # the kernels' layer view
    off, w = bank.offsets[group][j], bank.widths[group][j]
    assert torch.equal(pitched_view(bank.B[group][:, layer], slot, off, w, fb.shape[1]), fb)  # rank-pitched B
    ranks, scales = bank.layer_tables(group, layer)
    assert ranks.shape == (len(bank.widths[group]), bank.num_slots) and int(ranks[j, slot]) == fa.shape[0]
    assert scales.stride() == ranks.stride() and float(scales[j, slot]) != 0


def test_bank_allocates_only_the_groups_it_is_given():
    shapes = {g: SHAPES[g] for g in ("qkv", "o")}
    bank = ResidencyBank(LAYERS, shapes, 3, 8, torch.bfloat16, "cpu")
    total = sum(t.numel() * t.element_size() for d in (bank.A, bank.B, bank.ranks, bank.scales) for t in d.values())
    assert ResidencyBank.bytes_per_slot(LAYERS, shapes, 8, torch.bfloat16) * 3 == total
    assert ResidencyBank.bytes_per_slot(LAYERS, SHAPES, 8, torch.bfloat16) == \
        SlotBank.bytes_per_slot(LAYERS, SHAPES, 8, torch.bfloat16)


def test_a_bank_of_the_targeted_slices_only(pinned):
    """A bank sized for q/v adapters holds the q and v slices of the q/k/v group and nothing
    else: a slot costs exactly the adapter's factors (plus its rank/scale entries), a load
    copies no zeros for k (the whole-view image is the factors), the deltas equal a full
    bank's with the k columns of the projection untouched, and an adapter targeting a module
    the bank does not hold is refused with E_BANK_SHAPE (never served without it)."""
    slices = held_slices(["q_proj", "v_proj"])
    assert slices == {"qkv": (0, 2)}
    shapes = {"qkv": SHAPES["qkv"]}
    bank = ResidencyBank(LAYERS, shapes, 2, 4, torch.float32, "cpu", slices=slices, faults=FaultInjector())
    assert bank.widths["qkv"] == (SHAPES["qkv"][1][0], SHAPES["qkv"][1][2])
    q_out, kv_out = SHAPES["qkv"][1][:2]
    assert bank.out_offsets["qkv"] == [0, q_out + kv_out]
    d_in = SHAPES["qkv"][0]
    factors = 4 * (d_in + q_out) + 4 * (d_in + kv_out)  # rank 4: A and B of q and of v, per layer
    assert bank.slot_bytes == LAYERS * (factors * 4 + 2 * 8)
    art = bank.layout.artifact(pinned["qv"])
    assert all(p.index == () for p in art.pieces)  # whole views ...
    image = sum(p.src.numel() * p.src.element_size() for p in art.pieces if p.view.startswith(("A.", "B.")))
    assert image == LAYERS * factors * 4  # ... holding the factors and no k zeros
    full = SlotBank(LAYERS, SHAPES, 2, 8, torch.float32, "cpu")
    slot, ref_slot = bank.ensure(["qv"], pinned)["qv"], full.ensure(["qv"], pinned)["qv"]
    ctx = bank.context(torch.tensor([slot, -1, slot], dtype=torch.int32))
    ref_ctx = full.context(torch.tensor([ref_slot, -1, ref_slot], dtype=torch.int32))
    g = torch.Generator().manual_seed(5)
    for layer in range(LAYERS):
        x = torch.randn(3, d_in, generator=g)
        y = torch.randn(3, q_out + 2 * kv_out, generator=g)
        y0, y_ref = y.clone(), y.clone()
        ctx.apply(layer, "qkv", x, y)
        ref_ctx.apply(layer, "qkv", x, y_ref)
        torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-6)
        assert torch.equal(y[:, q_out : q_out + kv_out], y0[:, q_out : q_out + kv_out])  # k: not the bank's
        assert torch.equal(y[1], y0[1]) and not torch.equal(y[0], y0[0])
    with pytest.raises(CodedError) as e:  # "kvup" targets k_proj (and up_proj)
        bank.ensure(["kvup"], pinned)
    assert e.value.code == "E_BANK_SHAPE"
    with pytest.raises(ValueError):
        ResidencyBank(LAYERS, shapes, 2, 4, torch.float32, "cpu", slices={"qkv": (3,)})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_side_stream_loads_and_last_use_events(pinned):
    """The same engine on a GPU: pinned host images, copies on a side stream, CUDA events."""
    from mlora.batch.adapters.residency import CudaCopier

    bank = ResidencyBank(LAYERS, SHAPES, 2, 8, torch.float32, "cuda")
    ref = SlotBank(LAYERS, SHAPES, 5, 8, torch.float32, "cuda")
    assert isinstance(bank.residency.copier, CudaCopier) and bank.backend == "triton"
    rng = random.Random(1)
    for step in range(10):
        _same(bank, ref, rng.sample(sorted(ADAPTERS), rng.choice([1, 2])), pinned, step, atol=1e-5)
        bank.residency.audit()
    assert bank.stats.evictions >= 3
    art = bank.residency.host.get(pinned["qv"].semantic_sha256)
    assert art.pieces[0].src.is_pinned()
    slot_of = bank.ensure(["qv"], pinned)
    ctx = bank.context(torch.tensor([slot_of["qv"]], dtype=torch.int32))
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(200):  # keep the compute stream busy past the launch's last-use event
        busy = torch.tanh(busy @ busy)
    ctx.close()  # records the last-use event behind that work
    key = pinned["qv"].semantic_sha256
    assert "inflight_events" in bank.residency.ineligible(bank.residency.entry(key))
    with pytest.raises(NotEvictable):
        bank.residency.evict(key)
    torch.cuda.synchronize()
    assert bank.residency.ineligible(bank.residency.entry(key)) == []
    bank.residency.evict(key)
    bank.residency.audit()


def _slot_contents(bank, slot):
    return {n: t.select(d, slot).clone() for n, (t, d) in bank.residency.storage.tensors.items()}


def test_whole_view_images_and_pieces_land_the_same_slot_contents(pinned):
    """An image laid out as whole slot views (zeros included) and one laid out as pieces into
    a zeroed slot leave the same bytes in the slot, for every adapter of the fixture."""
    whole, parts = rbank(5), rbank(5)
    parts.layout.whole_views = lambda pieces: None
    names = sorted(ADAPTERS)
    kinds = {all(p.index == () for p in whole.layout.artifact(pinned[a]).pieces) for a in names}
    assert True in kinds  # the whole-view path is exercised (rank-8 adapters in rank-8 slots)
    assert not any(all(p.index == () for p in parts.layout.artifact(pinned[a]).pieces) for a in names)
    for a in names:
        s1, s2 = whole.ensure([a], pinned)[a], parts.ensure([a], pinned)[a]
        c1, c2 = _slot_contents(whole, s1), _slot_contents(parts, s2)
        assert c1.keys() == c2.keys() and all(torch.equal(c1[n], c2[n]) for n in c1), a


def test_images_built_in_a_worker_process_equal_those_built_here(pinned, tmp_path):
    """residency/build.py: a spawned worker builds the same image (pieces, bytes and the
    validation numbers); a worker that cannot build returns None (the caller rebuilds
    on its own thread and raises the real error); a bank with a worker serves the same
    deltas as the plain SlotBank."""
    import dataclasses

    bank = rbank(2, prefetch_workers=1, build_processes=1)
    try:
        here = bank.layout.artifact(pinned["qv"])
        there = bank.builder.build(bank.layout, pinned["qv"], pin=False)
        assert there is not None and bank.builder.built == 1
        assert [(p.view, p.index) for p in there.pieces] == [(p.view, p.index) for p in here.pieces]
        assert all(torch.equal(a.src, b.src) and a.src.dtype == b.src.dtype for a, b in zip(there.pieces, here.pieces))
        assert there.checks == here.checks and there.meta == here.meta and there.digest == here.digest
        gone = dataclasses.replace(pinned["qv"], modules=tuple(
            dataclasses.replace(m, a=dataclasses.replace(m.a, path=str(tmp_path / "missing.safetensors")))
            for m in pinned["qv"].modules))
        assert bank.builder.build(bank.layout, gone, pin=False) is None and bank.builder.failed == 1
        assert bank.prefetch(["qv", "kvup"], pinned) == 2
        ref = SlotBank(LAYERS, SHAPES, 5, 8, torch.float32, "cpu")
        _same(bank, ref, ["qv", "kvup"], pinned, 3)
        assert bank.builder.built == 3 and bank.prefetcher.used == 2
    finally:
        bank.close()


def test_a_builder_whose_workers_keep_dying_stops_trying():
    """residency/build.py: each dead pool is replaced, up to MAX_BROKEN_POOLS; then every build
    returns None at once (the bank builds on its own thread)."""
    from concurrent.futures.process import BrokenProcessPool

    from mlora.batch.adapters.residency import build as build_mod

    class DeadPool:
        submitted = 0

        def submit(self, *a, **k):
            DeadPool.submitted += 1
            raise BrokenProcessPool("worker died")

        def shutdown(self, **k):
            pass

    b = build_mod.ProcessBuilder(1)
    for _ in range(build_mod.MAX_BROKEN_POOLS + 2):
        b._pool = b._pool or DeadPool()
        assert b.build(None, None, pin=False) is None
    assert DeadPool.submitted == build_mod.MAX_BROKEN_POOLS and b.broken == build_mod.MAX_BROKEN_POOLS
    assert b.failed == build_mod.MAX_BROKEN_POOLS and b.built == 0


def _cache_image(bank, p):
    host = bank.residency.host
    host.register(p.semantic_sha256, p.semantic_sha256, lambda: bank._artifact(p))
    host.get(p.semantic_sha256)


def test_gpu_tier_prefetch_takes_free_or_unneeded_slots_only(pinned):
    """bank.prefetch_device: starts loads only for adapters whose host image is cached, into a
    free slot or the slot of an adapter no waiting row names; never evicts a wanted one;
    commit_device commits them (counted as prefetches), and the deltas are the plain SlotBank's."""
    bank = rbank(2, prefetch_workers=0)
    ref = SlotBank(LAYERS, SHAPES, 5, 8, torch.float32, "cpu")
    assert bank.prefetch_device(["qv"], pinned, 4) == 0  # no host image yet: never built here
    _cache_image(bank, pinned["qv"])
    assert bank.prefetch_device(["qv"], pinned, 4) == 1  # a free slot
    assert [a for a, _ in bank.commit_device()] == ["qv"] and bank.stats.prefetches == 1
    bank.ensure(["pattern"], pinned)
    bank.context(torch.tensor([0, 1], dtype=torch.int32)).close()  # both slots full, idle, last use recorded
    for name in ("kvup", "all"):
        _cache_image(bank, pinned[name])
    bank.want(["qv", "pattern"], pinned)  # both still needed by waiting rows
    assert bank.prefetch_device(["kvup"], pinned, 4) == 0 and bank.stats.evictions == 0
    bank.want(["qv", "kvup"], pinned)  # "pattern" is not needed any more: its slot may be taken
    assert bank.prefetch_device(["kvup", "all"], pinned, 4) == 1  # one unneeded slot, so one load
    bank.commit_device()
    assert set(bank.resident) == {pinned["qv"].semantic_sha256, pinned["kvup"].semantic_sha256}
    assert bank.stats.evictions == 1 and bank.stats.prefetches == 2
    _same(bank, ref, ["qv", "kvup"], pinned, 5)
    bank.residency.audit()


def test_gpu_tier_prefetch_that_fails_validation_is_dropped_and_loaded_on_demand(pinned):
    bank = rbank(2, prefetch_workers=0, trace=True)
    ref = SlotBank(LAYERS, SHAPES, 5, 8, torch.float32, "cpu")
    _cache_image(bank, pinned["kvup"])
    bank.residency.faults.corrupt(adapter="kvup", attempt=1, where="tail")
    assert bank.prefetch_device(["kvup"], pinned, 1) == 1
    assert bank.commit_device() == [] and bank.stats.rollbacks == 1  # rolled back, not published
    assert pinned["kvup"].semantic_sha256 not in bank.resident
    _same(bank, ref, ["kvup"], pinned, 2)  # the demand load (attempt 2) serves the right delta
    assert bank.stats.loads == 1 and bank.stats.load_failures == 1
    bank.residency.audit()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_worker_built_images_and_gpu_tier_prefetch(pinned):
    """On a GPU: images built in a worker process and pinned, GPU-tier prefetch copies on the
    side stream with validation reads queued behind them (storage.Probe), committed later;
    a corrupted prefetch is rolled back and the demand load serves the right delta."""
    import time as _time

    bank = ResidencyBank(LAYERS, SHAPES, 2, 8, torch.float32, "cuda", prefetch_workers=1, build_processes=1,
                         faults=FaultInjector())
    ref = SlotBank(LAYERS, SHAPES, 5, 8, torch.float32, "cuda")
    try:
        assert bank.prefetch(["qv", "kvup"], pinned) == 2
        deadline = _time.monotonic() + 120  # the worker's first build waits for its torch import
        while not all(bank.residency.host.cached(pinned[a].semantic_sha256) for a in ("qv", "kvup")):
            bank.prefetcher.collect()
            assert _time.monotonic() < deadline, "worker builds did not finish"
            _time.sleep(0.05)
        assert bank.builder.built == 2 and bank.residency.host.get(pinned["qv"].semantic_sha256).pieces[0].src.is_pinned()
        bank.residency.faults.corrupt(adapter="kvup", attempt=1, where="tail")
        assert bank.prefetch_device(["qv", "kvup"], pinned, 4) == 2
        done = [a for a, _ in bank.commit_device()]
        assert done == ["qv"] and bank.stats.rollbacks == 1  # kvup's corrupted copy was caught and rolled back
        _same(bank, ref, ["qv", "kvup"], pinned, 7, atol=1e-5)
        # each committed load's copy-stream time (copies + validation reads), rolled-back ones not counted
        assert len(bank.stats.load_device_seconds) == bank.stats.loads + bank.stats.prefetches
        assert all(0 < t < 5 for t in bank.stats.load_device_seconds)
        bank.residency.audit()
    finally:
        bank.close()


def test_start_load_statuses_and_fallback_to_the_blocking_path(pinned):
    """ResidencyBank.start_load (admission's asynchronous load): sync without a host image,
    started with one, loading while in flight, resident once committed; no-room when every
    slot is in use; after a failed asynchronous attempt the adapter goes the blocking way."""
    bank = rbank(2, prefetch_workers=0)
    ref = SlotBank(LAYERS, SHAPES, 5, 8, torch.float32, "cpu")
    assert bank.start_load("qv", pinned) == "sync"  # no image, none being built: ensure loads it
    for name in ("qv", "pattern", "kvup"):
        _cache_image(bank, pinned[name])
    assert bank.start_load("qv", pinned) == "started" and bank.loads_in_flight() == 1
    assert bank.start_load("qv", pinned) == "loading"
    assert [a for a, _ in bank.commit_device()] == ["qv"] and bank.start_load("qv", pinned) == "resident"
    assert bank.stats.loads == 1 and bank.loads_started_ahead == 1
    for name in ("qv", "pattern"):  # both slots leased by running requests
        bank.acquire(f"r-{name}", name, pinned)
    assert bank.start_load("kvup", pinned) == "no-room"
    bank.release("r-pattern")
    bank.residency.faults.corrupt(adapter="kvup", attempt=1, where="tail")
    assert bank.start_load("kvup", pinned) == "started"
    assert bank.commit_device() == [] and bank.stats.rollbacks == 1  # caught, rolled back, not published
    assert bank.start_load("kvup", pinned) == "sync"  # the blocking path, with its retries, from now on
    _same(bank, ref, ["qv", "kvup"], pinned, 4)
    bank.residency.audit()


def test_start_load_asks_for_the_host_image_and_waits_for_it(pinned, tmp_path):
    """With a prefetcher: a cold adapter without a host image gets its build requested and
    reports "building" (its rows wait, the engine thread builds nothing), then loads;
    a build that fails sends the adapter to the blocking path, which raises the error."""
    import dataclasses
    import time as _time

    from mlora.batch.adapters.catalog import AdapterError

    bank = rbank(2, prefetch_workers=1)
    try:
        assert bank.start_load("qv", pinned) == "building" and bank.prefetcher.issued == 1
        deadline = _time.monotonic() + 60
        while (status := bank.start_load("qv", pinned)) == "building":
            assert _time.monotonic() < deadline
            _time.sleep(0.01)
        assert status == "started" and [a for a, _ in bank.commit_device()] == ["qv"]
        gone = dataclasses.replace(pinned["kvup"], modules=tuple(
            dataclasses.replace(m, a=dataclasses.replace(m.a, path=str(tmp_path / "missing.safetensors")))
            for m in pinned["kvup"].modules))
        broken = {**pinned, "kvup": gone}
        assert bank.start_load("kvup", broken) == "building"
        deadline = _time.monotonic() + 60
        while (status := bank.start_load("kvup", broken)) == "building":
            assert _time.monotonic() < deadline
            _time.sleep(0.01)
        assert status == "sync"
        with pytest.raises(AdapterError):
            bank.ensure(["kvup"], broken)
    finally:
        bank.close()


def test_every_committed_load_records_its_copy_time(pinned):
    """Residency.stats.load_device_seconds: one figure per committed load or prefetch (the copy
    stream's time between marks around the copies and validation reads; on the CPU the
    synchronous copies' wall time), none for a rolled-back attempt; the job summary reports
    their mean and 90th percentile. load_issue_seconds: the host's time to issue every attempt."""
    bank = rbank(2, prefetch_workers=0)
    bank.residency.faults.corrupt(adapter="kvup", attempt=1, where="tail")
    for a in ("qv", "kvup", "pattern", "all"):
        bank.ensure([a], pinned)
        bank.context(torch.zeros(1, dtype=torch.int32)).close()
    s = bank.stats
    assert s.rollbacks == 1 and s.load_attempts == s.loads + 1
    assert len(s.load_device_seconds) == s.loads == 4 and all(t > 0 for t in s.load_device_seconds)
    assert s.as_dict()["load_device_seconds"] == list(s.load_device_seconds)
    # the host's time to issue a load: one figure per attempt, the rolled-back one included
    assert len(s.load_issue_seconds) == s.load_attempts == 5 and all(t > 0 for t in s.load_issue_seconds)
    assert s.as_dict()["load_issue_seconds"] == list(s.load_issue_seconds)
    # and the issuing thread's CPU time over the same spans: never more than their wall time
    assert len(s.load_issue_cpu_seconds) == s.load_attempts
    assert all(0 <= c <= w + 1e-4 for c, w in zip(s.load_issue_cpu_seconds, s.load_issue_seconds))


def test_a_collection_inside_a_load_issue_is_attributed_to_it(pinned):
    """load_issue_gc_seconds: the collector's pauses inside each load's host issue (from
    gcpauses.PAUSES while installed): a collection forced at the copy point of one load shows
    in that load's figure, within its issue time; the other loads' figures are what the
    collector really did meanwhile (never more than their issue time)."""
    import gc

    from mlora.batch.gcpauses import PAUSES

    bank = rbank(2, prefetch_workers=0)
    check = bank.residency.faults.check

    def collect_at_kvup(point, key, name, attempt):
        if point == "copy" and name == "kvup":
            gc.collect()
        return check(point, key, name, attempt)

    bank.residency.faults.check = collect_at_kvup
    PAUSES.install()
    try:
        for a in ("qv", "kvup", "pattern"):
            bank.ensure([a], pinned)
            bank.context(torch.zeros(1, dtype=torch.int32)).close()
    finally:
        PAUSES.uninstall()
    s = bank.stats
    assert len(s.load_issue_gc_seconds) == s.load_attempts == 3
    assert s.load_issue_gc_seconds[1] > 0  # the forced full collection, inside kvup's issue
    assert all(0 <= g <= w + 1e-4 for g, w in zip(s.load_issue_gc_seconds, s.load_issue_seconds))
    assert s.as_dict()["load_issue_gc_seconds"] == list(s.load_issue_gc_seconds)
