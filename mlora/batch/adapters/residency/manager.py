"""The residency manager: adapter generations in device slots, loaded as transactions.

Owns every adapter generation's state, its counts and the eviction predicate,
slot handles and their generations, request leases, launch snapshots, the load
transaction -- reserve, copy, validate, publish -- with compensating rollback and
retries, and joint admission of adapter and KV pages from one ledger (docs/design.md:
Residency states, Eviction eligibility, Slot generation, Lease, Launch snapshot,
Load transaction, Page ledger).
Must not know the model, the layout of a slot (``storage.py``) or where host
bytes come from (``host.py``).

Concurrency: single-threaded engine ownership plus stream events plus a
generation check at launch (a stale handle fails its launch). Device work is
asynchronous only through ``Event``s; every state move happens on the
calling thread, and a publication is one assignment of ``catalog[key]``.

Generations::

    generation        per adapter key; every load attempt takes the next one (a retry or a restored
                      victim is a new generation; a failed attempt's number is never reused)
    slot_generation   per slot; +1 whenever an occupant leaves (reclaim, eviction, aborted staging)
    pointer_generation per slot; +1 at every publication into the slot and whenever an occupant leaves
    catalog_generation +1 at every change of the visible key -> generation mapping

A :class:`Handle` is valid only while its slot still shows the same four-part
tuple, so a delayed stale handle can never match a reused slot (no ABA).
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from mlora.batch.adapters.residency.errors import (
    AdapterLoadError,
    AdmissionError,
    ArtifactRefused,
    KVCapacity,
    LedgerError,
    LoadError,
    NotEvictable,
    ResidencyError,
    RollbackError,
    ValidationError,
)
from mlora.batch.adapters.residency.events import DONE, Copier, CpuCopier, Event, complete
from mlora.batch.adapters.residency.faults import FaultInjector
from mlora.batch.adapters.residency.host import HostArtifact, HostCache
from mlora.batch.adapters.residency.pool import Owner, PagePool
from mlora.batch.adapters.residency.states import BINDABLE, EVICTABLE_STATES, State, check_transition
from mlora.batch.adapters.residency.storage import Probe, SlotProber, Storage, validate_landed
from mlora.batch.gcpauses import PAUSES

S = State


@dataclass(frozen=True)
class Handle:
    """One immutable published generation: (slot_id, slot_generation, pointer_generation,
    artifact_digest) (docs/design.md, Slot generation), plus the key, adapter generation and page table it names."""

    slot_id: int
    slot_generation: int
    pointer_generation: int
    artifact_digest: str
    key: str
    generation: int
    pages: tuple[int, ...]

    @property
    def label(self) -> str:
        return f"{self.key}@g{self.generation}"


@dataclass(frozen=True)
class RequestAttempt:
    """A request's admission attempt: a retry gets a new id and keeps the original arrival."""

    request_id: str
    attempt: int = 1
    arrival: float = 0.0

    @property
    def id(self) -> str:
        return f"{self.request_id}#{self.attempt}"

    def retry(self) -> "RequestAttempt":
        return replace(self, attempt=self.attempt + 1)


@dataclass(eq=False)
class Entry:
    """One adapter generation and its counts (docs/design.md, Eviction eligibility)."""

    key: str
    digest: str
    generation: int
    artifact: HostArtifact
    state: State = S.ABSENT
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    refcount: int = 0  # leases of admitted or running request attempts
    pin_count: int = 0  # explicit policy/operator pins
    queued_reservations: int = 0  # queue entries or plans that assume it stays resident
    events: list[Event] = field(default_factory=list)  # copies and launches that may still touch its pages
    last_touch: int = 0
    prefetched: bool = False
    txn: str | None = None  # the open transaction loading it or holding it as a victim
    probe: Probe | None = None  # issued after its copies (read at validation), while loading
    timing: tuple | None = None  # (start, copied, end) copier marks: before the copies, after them, after validation's reads

    @property
    def label(self) -> str:
        return f"{self.key}@g{self.generation}"

    @property
    def owner(self) -> Owner:
        return Owner.adapter(self.key, self.generation)

    def inflight_events(self) -> int:
        self.events = [e for e in self.events if not e.query()]
        return len(self.events)


@dataclass(eq=False)
class Slot:
    id: int
    slot_generation: int = 0
    pointer_generation: int = 0
    entry: Entry | None = None  # the published (or retiring, still mapped) occupant
    txn: str | None = None  # an open transaction writing into it
    last_use: Event | None = None


@dataclass(eq=False)
class Txn:
    id: str
    key: str | None
    attempt: int
    request: str | None
    kv_pages: int
    growth_pages: int
    pages: list[int]  # everything reserved, sorted
    adapter_pages: list[int]
    kv: list[int]  # initial KV + growth reserve of the request
    entry: Entry | None  # the generation being loaded
    slot: Slot | None
    victims: list[tuple[Entry, Slot, list[int]]]
    hit: Entry | None  # the resident generation a request binds without a load
    prefetch: bool = False
    copy_event: Event = DONE
    validate_event: Event = DONE
    started: float = 0.0


@dataclass(frozen=True)
class Admission:
    txn: str
    handle: Handle | None
    kv_pages: tuple[int, ...]
    request: str | None
    attempts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Demand:
    """The two sides of the joint admission inequality, in pages (``bytes`` converts exactly)."""

    adapter: int
    kv_initial: int
    kv_growth: int
    guard: int
    free: int
    reclaimable: int
    page_bytes: int

    @property
    def total(self) -> int:
        return self.adapter + self.kv_initial + self.kv_growth + self.guard

    @property
    def available(self) -> int:
        return self.free + self.reclaimable

    @property
    def ok(self) -> bool:
        return self.available >= self.total

    def bytes(self, pages: int) -> int:
        return pages * self.page_bytes


@dataclass
class KVRecord:
    pages: list[int]
    used: int  # pages holding tokens; the rest of ``pages`` is the decode-growth reserve


@dataclass
class ResidencyStats:
    hits: int = 0
    misses: int = 0
    loads: int = 0  # generations published for a request or plan (not restorations)
    prefetches: int = 0
    prefetch_used: int = 0
    restores: int = 0  # victims re-published by rollback
    load_attempts: int = 0
    load_failures: int = 0
    rollbacks: int = 0
    evictions: int = 0
    reclaims: int = 0  # retired generations reclaimed after their fences
    h2d_bytes: int = 0  # every byte copied host -> device, restorations and failed attempts included
    unique_load_bytes: int = 0  # bytes of distinct artifacts published for use (load amplification denominator)
    load_seconds: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096))
    # device time of each committed load's copies and validation reads on the copy stream (the
    # figure the cold-load target compares with its floor; CPU: the synchronous copies' wall time)
    load_device_seconds: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096))
    # of which the copies alone (start mark to the mark after the last copy)
    load_copy_seconds: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096))
    # host time to issue each load's copies and probe (start mark to end mark): the copy stream
    # cannot finish a load before the host has issued all of it
    load_issue_seconds: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096))
    # the issuing thread's CPU time over the same span: wall time well above it is time the
    # thread waited (for the interpreter lock behind prefetch builders, or a driver lock)
    load_issue_cpu_seconds: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096))
    # the garbage collector's pauses inside the same span (any thread's: a collection holds the
    # interpreter lock), from gcpauses.PAUSES while an EngineSession has it installed (else zeros)
    load_issue_gc_seconds: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096))

    def as_dict(self) -> dict:
        out = dict(self.__dict__)
        for name in PER_LOAD_STATS:
            out[name] = list(getattr(self, name))
        return out


PER_LOAD_STATS = ("load_seconds", "load_device_seconds", "load_copy_seconds", "load_issue_seconds",
                  "load_issue_cpu_seconds", "load_issue_gc_seconds")


class Launch:
    """A launch snapshot: the handles one kernel launch reads. Live until :meth:`finish` is
    given an event and that event completes; its generations are then no longer named."""

    def __init__(self, res: "Residency", handles: tuple[Handle, ...], batch_generation, catalog_generation: int):
        self._res, self.handles = res, handles
        self.batch_generation, self.catalog_generation = batch_generation, catalog_generation
        self.event: Event | None = None

    @property
    def live(self) -> bool:
        return self.event is None or not self.event.query()

    def finish(self, event: Event = DONE) -> None:
        self.event = event
        for h in self.handles:
            slot = self._res.slots[h.slot_id]
            slot.last_use = event
            if slot.entry is not None:
                slot.entry.inflight_events()  # prune, so a hot adapter's list stays short
                slot.entry.events.append(event)


class Residency:
    """Adapter residency over ``storage`` slots, with ``pool`` as the one joint page ledger."""

    def __init__(self, storage: Storage, pool: PagePool, host: HostCache | None = None, *,
                 copier: Copier | None = None, faults: FaultInjector | None = None, max_load_attempts: int = 3,
                 guard_pages: int = 0, trace: bool = False, mirror: Callable[[int, str], None] | None = None):
        """``mirror(slot_id, key)``: called on the engine thread right after every copy into a
        slot is issued (a load's or a victim's restoration), e.g. for the other tensor-parallel
        ranks to write their cut of ``key`` into the same slot before it can be published; it
        raises a ResidencyError (``MirrorError``) to fail the copy, which rolls the attempt back."""
        if max_load_attempts < 1:
            raise ValueError("max_load_attempts must be >= 1")
        self.storage, self.pool = storage, pool
        self.host = host if host is not None else HostCache()
        self.copier = copier if copier is not None else CpuCopier()
        self.prober = SlotProber()  # a slot's probe buffers, prepared once (storage.SlotProber)
        self.faults = faults if faults is not None else FaultInjector()
        self.max_load_attempts, self.guard_pages = max_load_attempts, guard_pages
        self.mirror = mirror
        self.slots = [Slot(i) for i in range(storage.num_slots)]
        self.catalog: dict[str, Entry] = {}
        self.catalog_generation = 0
        self.tombstones: list[tuple[str, int]] = []
        self.stats = ResidencyStats()
        self.trace: list[str] | None = [] if trace else None
        self._live: list[Entry] = []  # every generation not absent
        # keys that queued work still needs (set by the scheduler): ranked last among eviction victims
        self.wanted: frozenset[str] = frozenset()
        self._txns: dict[str, Txn] = {}
        self._leases: dict[str, Entry] = {}
        self._lease_handles: dict[str, Handle] = {}
        self._kv: dict[str, KVRecord] = {}
        self._launches: list[Launch] = []
        self._last_generation: dict[str, int] = {}
        self._attempts: dict[str, int] = {}
        self._loaded_digests: set[str] = set()
        self._txn_ids = itertools.count(1)
        self._clock = itertools.count(1)

    # ---- views ---------------------------------------------------------------------

    def handle_of(self, entry: Entry) -> Handle:
        slot = self.slots[entry.slot]
        if slot.entry is not entry:
            raise ResidencyError("E_RESIDENCY_NOT_PUBLISHED", f"{entry.label} is not mapped in a slot")
        return Handle(slot.id, slot.slot_generation, slot.pointer_generation, entry.digest, entry.key,
                      entry.generation, tuple(entry.pages))

    def resolve(self, key: str) -> Handle | None:
        """The published handle ``key`` names now (None when it names none)."""
        e = self.catalog.get(key)
        return self.handle_of(e) if e is not None else None

    def entry(self, key: str) -> Entry | None:
        return self.catalog.get(key)

    def entries(self) -> list[Entry]:
        return list(self._live)

    def is_current(self, h: Handle) -> bool:
        slot = self.slots[h.slot_id]
        e = slot.entry
        return (e is not None and e.state in (S.PUBLISHED, S.ACTIVE, S.IDLE, S.RETIRING)
                and (e.key, e.generation, e.digest) == (h.key, h.generation, h.artifact_digest)
                and (slot.slot_generation, slot.pointer_generation) == (h.slot_generation, h.pointer_generation))

    def state_counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in State}
        for e in self._live:
            out[e.state.value] += 1
        return out

    def open_transactions(self) -> list[Txn]:
        return list(self._txns.values())

    def loading(self, key: str) -> Txn | None:
        return next((t for t in self._txns.values() if t.entry is not None and t.entry.key == key), None)

    def kv_pages(self, request: str) -> list[int]:
        rec = self._kv.get(request)
        return list(rec.pages) if rec else []

    def lease(self, request: str) -> Handle:
        e = self._leases.get(request)
        if e is None:
            raise ResidencyError("E_RESIDENCY_NO_LEASE", f"request {request} holds no adapter lease")
        return self._lease_handles[request]

    def seed_slot(self, slot: int, slot_generation: int, pointer_generation: int) -> None:
        """Start a free slot's generations at given values (fixtures that name them)."""
        s = self.slots[slot]
        if s.entry is not None or s.txn is not None:
            raise ResidencyError("E_RESIDENCY_SLOT_BUSY", f"slot {slot} is not free")
        s.slot_generation, s.pointer_generation = slot_generation, pointer_generation

    # ---- eligibility (docs/design.md, Eviction eligibility) ----------------------------

    def live_generations(self) -> set[tuple[str, int]]:
        self._launches = [l for l in self._launches if l.live]
        return {(h.key, h.generation) for l in self._launches for h in l.handles}

    def ineligible(self, entry: Entry, live: set[tuple[str, int]] | None = None) -> list[str]:
        """The clauses of the eviction predicate that ``entry`` fails (empty: evictable)."""
        live = self.live_generations() if live is None else live
        reasons = []
        if entry.state not in EVICTABLE_STATES or entry.txn is not None:
            reasons.append("state")
        for clause in ("refcount", "pin_count", "queued_reservations"):
            if getattr(entry, clause):
                reasons.append(clause)
        if entry.inflight_events():
            reasons.append("inflight_events")
        if (entry.key, entry.generation) in live:
            reasons.append("live_launch")
        if not self.host.has_source(entry.digest):
            reasons.append("host_source")
        return reasons

    def evictable(self, key: str) -> bool:
        e = self.catalog.get(key)
        return e is not None and not self.ineligible(e)

    def eligible_victims(self) -> list[Entry]:
        """The entries eviction may take now, in the order it would take them."""
        return self._eligible(set())

    def free_slot(self):
        """A slot holding nothing and reserved by nothing, or None."""
        return self._free_slot()

    def _eligible(self, exclude: set) -> list[Entry]:
        live = self.live_generations()
        cands = [e for e in self._live if e not in exclude and e.slot is not None and not self.ineligible(e, live)]
        # among eligible slots only: adapters no queued row needs first, then LRU, then larger, then identity
        cands.sort(key=lambda e: (e.key in self.wanted, e.last_touch, -len(e.pages), e.key))
        return cands

    def _choose_victims(self, pages_needed: int, slots_needed: int, exclude: set, demand: Demand | None = None,
                        what: str = "") -> list[Entry]:
        if pages_needed <= 0 and slots_needed <= 0:
            return []
        victims, pages, slots = [], 0, 0
        for e in self._eligible(exclude):
            if pages >= pages_needed and slots >= slots_needed:
                break
            victims.append(e)
            pages += len(e.pages)
            slots += 1
        if demand is not None:
            demand = replace(demand, reclaimable=pages)
        if slots < slots_needed:
            raise AdmissionError("E_ADMISSION_CAPACITY", "adapter_slot_capacity", f"{what}needs an adapter slot; "
                                 "every slot holds an adapter that is in use, pinned, reserved or still referenced "
                                 "by device work", demand)
        if pages < pages_needed:
            raise AdmissionError("E_ADMISSION_CAPACITY", "joint_adapter_kv_capacity", f"{what}needs {pages_needed} "
                                 f"more pages ({pages_needed * self.pool.page_bytes} bytes) than are free, only "
                                 f"{pages} are reclaimable from eligible idle adapters; queue it until pages free up",
                                 demand)
        return victims

    # ---- joint admission (docs/design.md, Page ledger) -------------------------------

    def demand(self, key: str | None = None, kv_pages: int = 0, growth_pages: int = 0, *,
               digest: str | None = None) -> Demand:
        adapter, exclude = 0, set()
        if key is not None:
            hit = self._hit(key, digest)
            if hit is not None:
                exclude = {hit}
            else:
                adapter = self.storage.pages_for(self._peek_artifact(key, digest))
        reclaimable = sum(len(e.pages) for e in self._eligible(exclude))
        return Demand(adapter, kv_pages, growth_pages, self.guard_pages, self.pool.free_count, reclaimable,
                      self.pool.page_bytes)

    def can_admit(self, key: str | None = None, kv_pages: int = 0, growth_pages: int = 0, *,
                  digest: str | None = None) -> tuple[bool, str, Demand]:
        """Would :meth:`begin` accept this now? (ok, reason, demand) -- no state changes."""
        d = self.demand(key, kv_pages, growth_pages, digest=digest)
        if d.adapter:
            try:
                self.storage.check_artifact(self._peek_artifact(key, digest))
            except ValidationError:
                return False, "adapter_kernel_contract", d
        if not d.ok:
            return False, "joint_adapter_kv_capacity", d
        if d.adapter and self._free_slot() is None and not self._eligible(set()):
            return False, "adapter_slot_capacity", d
        return True, "ok", d

    def _hit(self, key: str, digest: str | None) -> Entry | None:
        e = self.catalog.get(key)
        if e is not None and e.state in BINDABLE and (digest is None or e.digest == digest):
            return e
        return None

    def _peek_artifact(self, key: str, digest: str | None) -> HostArtifact:
        return self.host.get(digest or self.host.digest_of(key))

    # ---- the load transaction (docs/design.md, Load transaction) ------------------------

    def begin(self, key: str | None = None, *, request: str | None = None, kv_pages: int = 0,
              growth_pages: int = 0, digest: str | None = None, generation: int | None = None,
              txn_id: str | None = None, slot: int | None = None, replace: bool = False,
              prefetch: bool = False) -> Txn:
        """Start one admission attempt: validate the artifact, derive the joint demand, choose
        victims, reserve every page atomically, retire the victims and issue the copy.

        ``key=None`` reserves KV only. A resident generation of ``key`` is bound without a
        load (unless ``replace``: a shadow copy that publishes a new generation).
        Raises AdmissionError (nothing changed), ArtifactRefused (or the host source's
        AdapterError) for an artifact refused before any eviction, LoadError after rolling the
        attempt back, RollbackError when the rollback could not restore a victim.

        One transaction from reservation to the copy's issue, kept in one piece so its rollback points read in order."""
        self.collect()
        if request is not None and self._bound(request):
            raise ResidencyError("E_RESIDENCY_REQUEST_BOUND", f"request attempt {request} is already admitted; "
                                 "a retry needs a new attempt id")
        if min(kv_pages, growth_pages) < 0:
            raise ValueError("page counts must be >= 0")
        hit = artifact = None
        attempt = 0
        if key is not None:
            hit = None if replace else self._hit(key, digest)
            pending = self.loading(key)
            if hit is None and pending is not None:
                raise ResidencyError("E_RESIDENCY_LOAD_IN_FLIGHT", f"{pending.entry.label} is being loaded by "
                                     f"{pending.id}; wait for it (poll/wait) or cancel it first")
            if hit is None:
                digest = digest or self.host.digest_of(key)
                attempt = self._attempts.get(key, 0) + 1  # counted once the attempt reserves pages
                self._log(f"validate-identity {key}")
                self.faults.check("host", key, key, attempt)
                artifact = self.host.get(digest)
                try:
                    self.storage.check_artifact(artifact)  # refused here, before any destructive step
                except ValidationError as exc:
                    raise ArtifactRefused(exc.code, exc.message, artifact.name) from None
        need = self.storage.pages_for(artifact) if artifact is not None else 0
        total = need + kv_pages + growth_pages
        if artifact is not None:
            self._log(f"demand {key} adapter={need} kv={kv_pages} growth={growth_pages} total={total}")
        target = self._free_slot(slot) if artifact is not None else None
        exclude = {e for e in self._live if e.key == key} if key is not None else set()
        demand = Demand(need, kv_pages, growth_pages, self.guard_pages, self.pool.free_count, 0, self.pool.page_bytes)
        victims = self._choose_victims(total + self.guard_pages - self.pool.free_count,
                                       1 if artifact is not None and target is None else 0, exclude, demand,
                                       f"admitting {key or 'KV'} ")
        txn_id = txn_id or f"tx{next(self._txn_ids)}"
        if txn_id in self._txns:
            raise ResidencyError("E_RESIDENCY_TXN_ID", f"transaction {txn_id} is already open")
        # a slot made of fixed pages (one arena): the adapter gets exactly its slot's pages, the
        # free ones of a free slot or the victim's of a reused one
        fixed = None
        if artifact is not None:
            fixed = self._slot_pages((target or self.slots[victims[0].slot]).id)
        specific = tuple(p for p in fixed if self.pool.owner(p) is None) if fixed else ()
        # ---- destructive from here: every failure below is rolled back ----
        if artifact is not None:
            self._attempts[key] = attempt
        victim_slots = []
        for v in victims:
            victim_slots.append(self._retire_victim(v, txn_id))
        victim_pages = sum(len(v.pages) for v in victims)
        pages = self.pool.take(max(0, total - victim_pages - len(specific)), Owner.reserved(txn_id),
                               tuple((v.owner, list(v.pages)) for v in victims), specific)
        self._log(f"reserve {txn_id} {pages}")
        if fixed:
            own = set(fixed)
            adapter_pages, kv = list(fixed), [p for p in pages if p not in own][:kv_pages + growth_pages]
        else:
            adapter_pages, kv = pages[:need], pages[need:need + kv_pages + growth_pages]
        txn = Txn(txn_id, key, attempt, request, kv_pages, growth_pages, pages, adapter_pages, kv, None, None,
                  [(v, s, list(v.pages)) for v, s in zip(victims, victim_slots)], hit, prefetch,
                  started=time.perf_counter())
        self._txns[txn_id] = txn
        if hit is not None:
            hit.queued_reservations += 1  # the attempt assumes it stays resident until commit
        if artifact is None:
            return txn
        if target is None:
            target = victim_slots[0]
        target.txn = txn_id
        txn.slot = target
        txn.entry = self._new_entry(key, artifact, generation)
        txn.entry.prefetched = prefetch
        try:
            self._reserve_entry(txn.entry, target, txn.adapter_pages, txn_id)
            txn.copy_event, txn.validate_event = self._copy(txn.entry, target, attempt)
        except ResidencyError as exc:
            self._rollback(txn, exc)
            raise
        return txn

    def poll(self, txn: Txn) -> bool:
        """Advance without blocking; True once the attempt is committed (published and bound)."""
        if txn.id not in self._txns:
            return True
        if not (txn.copy_event.query() and txn.validate_event.query()):
            return False
        self._finish(txn)
        return True

    def wait(self, txn: Txn) -> Admission:
        """Wait for the attempt's events, then validate, publish and commit it."""
        txn.copy_event.synchronize()
        txn.validate_event.synchronize()
        return self._finish(txn)

    def publish(self, txn: Txn) -> Handle:
        """The one visibility point: a validated generation becomes the key's catalog entry.
        Refuses (no change) while the copy-complete event is incomplete."""
        e = txn.entry
        if e is None:
            raise ResidencyError("E_RESIDENCY_NOTHING_TO_PUBLISH", f"transaction {txn.id} loads no adapter")
        if not txn.copy_event.query():
            raise ResidencyError("E_RESIDENCY_PUBLISH_BEFORE_COPY", f"{e.label}: the copy-complete event of "
                                 f"{txn.id} has not completed; publishing now could expose partial bytes")
        check_transition(e.label, e.state, S.PUBLISHED)
        self._publish_entry(e, txn.slot, txn.id)
        return self.handle_of(e)

    def cancel(self, txn: Txn, keep_adapter: bool = False) -> None:
        """Cancel an open attempt (e.g. its request was cancelled during the transfer): wait for
        its events and roll it back. ``keep_adapter`` releases only the request's part; the
        adapter load continues as a prefetch (wait/poll it as before)."""
        if txn.id not in self._txns:
            raise ResidencyError("E_RESIDENCY_TXN_CLOSED", f"transaction {txn.id} is not open")
        if keep_adapter and txn.entry is not None:
            self._log(f"release-request {txn.request} (load of {txn.entry.label} continues)")
            txn.request, txn.kv, txn.prefetch = None, [], True
            txn.entry.prefetched = True
            return
        self._rollback(txn, ResidencyError("E_RESIDENCY_CANCELLED", f"transaction {txn.id} cancelled"))

    def _finish(self, txn: Txn) -> Admission:
        e = txn.entry
        if e is not None and e.state is S.LOADING:
            self._log(f"copy-complete {e.label}")
            try:
                self.faults.check("validate", e.key, e.artifact.name, txn.attempt)
                probe, e.probe = e.probe, None
                with self.copier.side():  # on the copy stream: never waits for queued iterations
                    validate_landed(self.storage, self.storage.views(txn.slot.id, e.pages), e.artifact, probe)
            except ValidationError as exc:
                self._rollback(txn, exc)
                raise
            self._move(e, S.VALIDATED)
            self._log(f"validate {e.label}")
        if e is not None and e.state is S.VALIDATED:
            self.publish(txn)
        return self._commit(txn)

    def _commit(self, txn: Txn) -> Admission:
        bound = txn.entry or txn.hit
        handle = None
        if txn.hit is not None:
            txn.hit.queued_reservations -= 1
        if bound is not None:
            bound.txn = None
            if txn.slot is not None:
                txn.slot.txn = None
            if txn.request is not None:
                self._bind(bound, txn.request)
                self._log(f"lease {bound.label} {txn.request}")
            handle = self.handle_of(bound)
            self._touch(bound)
        if txn.request is not None and txn.kv:
            self.pool.move(txn.kv, Owner.reserved(txn.id), Owner.kv(txn.request))
            self._kv[txn.request] = KVRecord(list(txn.kv), txn.kv_pages)
            self._log(f"commit-kv {txn.request} {txn.kv}")
        for v, vslot, _ in txn.victims:
            self._tombstone(v)
            self.stats.evictions += 1
            if vslot is not txn.slot:
                vslot.txn = None
        spare = self.pool.pages_of(Owner.reserved(txn.id))
        if spare:
            self.pool.release(spare, Owner.reserved(txn.id))
            self._log(f"free {txn.id} {spare}")
        del self._txns[txn.id]
        if txn.entry is not None:
            if txn.entry.digest not in self._loaded_digests:
                self._loaded_digests.add(txn.entry.digest)
                self.stats.unique_load_bytes += txn.entry.artifact.nbytes
            if txn.entry.state in BINDABLE:  # landed and validated: the entry needs no host bytes any more
                txn.entry.artifact = txn.entry.artifact.header()
            self.stats.prefetches += txn.prefetch
            self.stats.loads += not txn.prefetch
            self.stats.load_seconds.append(time.perf_counter() - txn.started)
            if txn.entry.timing is not None:
                start, copied, end = txn.entry.timing
                device_s, copy_s = self.copier.elapsed(start, end), self.copier.elapsed(start, copied)
                txn.entry.timing = None
                if device_s is not None:
                    self.stats.load_device_seconds.append(device_s)
                if copy_s is not None:
                    self.stats.load_copy_seconds.append(copy_s)
        return Admission(txn.id, handle, tuple(txn.kv if txn.request else ()), txn.request)

    # ---- rollback ---------------------------------------------------------------------

    def _rollback(self, txn: Txn, exc: ResidencyError) -> None:
        """Compensating work: close every ownership the attempt opened and restore its victims
        under fresh generations. Raises RollbackError (from ``exc``) if a victim cannot be restored."""
        self._log(f"fail {txn.id} {exc.code}")
        for ev in (txn.copy_event, txn.validate_event, self.copier.record()):
            ev.synchronize()  # device work cannot be recalled: wait for it before touching the pages
        self._log(f"cancel-events {txn.id}")
        e = txn.entry
        if e is not None:
            self._drop_staged(e, txn.slot)
            self.stats.load_failures += 1
        if txn.hit is not None:
            txn.hit.queued_reservations -= 1
        if txn.request is not None and txn.kv:
            self._log(f"release-kv {txn.request}")
        lost = []
        for v, vslot, vpages in txn.victims:
            try:
                self._restore(txn, v, vslot, vpages)
            except ResidencyError as rexc:
                lost.append(f"{v.label}: {rexc}")
            self._tombstone(v)
        rest = self.pool.pages_of(Owner.reserved(txn.id))
        if rest:
            self.pool.release(rest, Owner.reserved(txn.id))
            self._log(f"free {txn.id} {rest}")
        for s in self.slots:
            if s.txn == txn.id:
                s.txn = None
        del self._txns[txn.id]
        self.stats.rollbacks += 1
        exc.txn, exc.attempt = txn.id, txn.attempt
        if lost:
            code = ("E_RESIDENCY_NO_HOST_SOURCE" if any("E_RESIDENCY_NO_HOST_SOURCE" in m for m in lost)
                    else "E_RESIDENCY_RESTORE_FAILED")
            raise RollbackError(code, f"rollback of {txn.id} ({exc.code}) could not restore {'; '.join(lost)}; "
                                "those adapters are absent now and load again on demand") from exc

    def _restore(self, txn: Txn, victim: Entry, slot: Slot, pages: list[int]) -> None:
        if not self.host.has_source(victim.digest):
            raise ResidencyError("E_RESIDENCY_NO_HOST_SOURCE", f"no verified host source for {victim.label}")
        attempt = self._attempts[victim.key] = self._attempts.get(victim.key, 0) + 1
        self.faults.check("host", victim.key, victim.artifact.name, attempt)
        e = self._new_entry(victim.key, self.host.get(victim.digest))
        e.last_touch = victim.last_touch  # restoring does not make it recently used
        slot.txn = txn.id
        try:
            self._reserve_entry(e, slot, pages, txn.id)
            self._log(f"restore {e.label} -> {pages}")
            copy_event, validate_event = self._copy(e, slot, attempt)
            copy_event.synchronize()
            validate_event.synchronize()
            self.faults.check("validate", e.key, e.artifact.name, attempt)
            probe, e.probe = e.probe, None
            with self.copier.side():
                validate_landed(self.storage, self.storage.views(slot.id, pages), e.artifact, probe)
        except ResidencyError as exc:
            self._drop_staged(e, slot)
            raise ResidencyError("E_RESIDENCY_RESTORE_FAILED", str(exc)) from exc
        self._move(e, S.VALIDATED)
        self._log(f"validate {e.label}")
        self._publish_entry(e, slot, txn.id)
        e.artifact = e.artifact.header()  # restored and validated: no host bytes held (see _commit)
        e.txn = None
        slot.txn = None
        self.stats.restores += 1

    # ---- retries ----------------------------------------------------------------------

    def load(self, key: str, *, digest: str | None = None) -> Handle:
        """Make ``key`` resident (no request bound); retried with a new attempt and generation
        after each rolled-back failure, E_ADAPTER_LOAD after ``max_load_attempts``."""
        return self._with_retries(key, lambda _: self.wait(self.begin(key, digest=digest)), None).handle

    def admit(self, key: str | None, request: RequestAttempt, kv_pages: int = 0, growth_pages: int = 0) -> Admission:
        """Joint admission of one request (adapter + initial KV + growth reserve), retried under
        a new attempt id that keeps the original arrival. Raises AdmissionError when it does
        not fit now (queue it), AdapterLoadError after the retry budget."""
        return self._with_retries(key, lambda r: self.wait(self.begin(
            key, request=r.id, kv_pages=kv_pages, growth_pages=growth_pages)), request)

    def _with_retries(self, key, run, request: RequestAttempt | None) -> Admission:
        tried, last = [], None
        for _ in range(self.max_load_attempts):
            try:
                out = run(request)
            except LoadError as exc:  # already rolled back; RollbackError and refusals are not retried
                last = exc
                tried.append(request.id if request else f"{key}#{exc.attempt}")
                request = request.retry() if request else None
                continue
            label = request.id if request else f"{key}#{self._attempts.get(key, 0)}"
            return replace(out, attempts=tuple(tried + [label]))
        raise AdapterLoadError(self._name(key), tried, last) from last

    def _name(self, key: str | None) -> str:
        try:
            return self.host.get(self.host.digest_of(key)).name
        except ResidencyError:
            return str(key)

    def prefetch(self, key: str) -> Txn | None:
        """Start a speculative load from the same ledger; None when ``key`` is resident or
        loading, or when it does not fit without touching pages that are not reclaimable."""
        if self._hit(key, None) is not None or self.loading(key) is not None:
            return None
        ok, _, _ = self.can_admit(key)
        if not ok:
            return None
        return self.begin(key, prefetch=True)

    # ---- KV pages --------------------------------------------------------------------

    def reserve_kv(self, request: str, kv_pages: int, growth_pages: int = 0) -> list[int]:
        """KV pages (initial + growth reserve) for a request without an adapter to load."""
        return list(self.wait(self.begin(None, request=request, kv_pages=kv_pages, growth_pages=growth_pages)).kv_pages)

    def take_kv(self, request: str, n: int) -> list[int]:
        """``n`` KV pages for a request that holds none: taken at once, lowest first, when free
        pages cover them beside the guard (one ledger move: nothing to evict, so no
        transaction), else through :meth:`reserve_kv` (victims chosen, a transaction, rolled
        back on failure). The engine's joint memory mode calls it for every new row."""
        if n <= 0 or n + self.guard_pages > self.pool.free_count or self._bound(request):
            return self.reserve_kv(request, n)  # (which refuses a bound request)
        pages = self.pool.take(n, Owner.kv(request))
        self._kv[request] = KVRecord(list(pages), n)
        if self.trace is not None:  # the message lists every page: built only when traced
            self._log(f"kv {request} {pages}")
        return pages

    def _bound(self, request: str) -> bool:
        """Whether a request attempt holds a lease, KV pages or an open transaction."""
        return request in self._leases or request in self._kv or any(t.request == request for t in self._txns.values())

    def holds_kv(self, request: str) -> bool:
        """Whether ``request`` holds a KV reservation."""
        return request in self._kv

    def grow_kv(self, request: str, n: int = 1) -> list[int]:
        """``n`` more KV pages for ``request``: its growth reserve first, then free pages, then
        pages of evictable adapters. Raises KVCapacity (nothing changed) rather than over-commit."""
        rec = self._kv.get(request)
        if rec is None:
            raise ResidencyError("E_RESIDENCY_NO_KV", f"request {request} holds no KV reservation")
        start = rec.used
        extra = n - min(n, len(rec.pages) - rec.used)
        if extra:
            try:
                victims = self._choose_victims(extra + self.guard_pages - self.pool.free_count, 0, set())
            except AdmissionError:
                avail = self.pool.free_count + sum(len(e.pages) for e in self._eligible(set()))
                raise KVCapacity(request, extra, max(0, avail - self.guard_pages)) from None
            for v in victims:
                self._evict_now(v)
            rec.pages += self.pool.take(extra, Owner.kv(request))
        rec.used += n
        return rec.pages[start:rec.used]

    def release_kv(self, request: str) -> None:
        rec = self._kv.pop(request, None)
        if rec is not None:
            self.pool.release(rec.pages, Owner.kv(request))

    # ---- leases (docs/design.md, Lease), pins, queued reservations --------------------------

    def acquire(self, request: str, key: str) -> Handle:
        """Bind a request attempt to the generation ``key`` names now, for its whole lifetime."""
        if request in self._leases:
            raise ResidencyError("E_RESIDENCY_REQUEST_BOUND", f"request attempt {request} already holds a lease")
        e = self._hit(key, None)
        if e is None:
            raise ResidencyError("E_RESIDENCY_NOT_PUBLISHED", f"adapter {key!r} has no published generation; "
                                 "a cold adapter is load-eligible, not executable")
        self._bind(e, request)
        return self._lease_handles[request]

    def release_lease(self, request: str) -> None:
        e = self._leases.pop(request, None)
        if e is None:
            return
        self._lease_handles.pop(request, None)
        e.refcount -= 1
        if e.refcount == 0 and e.state is S.ACTIVE:
            self._move(e, S.IDLE)
        if e.state is S.RETIRING:
            self.collect()

    def finish_request(self, request: str) -> None:
        """A request attempt ended (finished, failed or cancelled): drop its lease and KV pages."""
        self.release_lease(request)
        self.release_kv(request)

    def _bind(self, e: Entry, request: str) -> None:
        e.refcount += 1
        if e.state in (S.PUBLISHED, S.IDLE):
            self._move(e, S.ACTIVE)
        self._used(e)
        self._leases[request] = e
        self._lease_handles[request] = self.handle_of(e)

    def _used(self, e: Entry) -> None:
        self._touch(e)
        if e.prefetched:  # first real use of a prefetched generation (prefetch precision)
            e.prefetched = False
            self.stats.prefetch_used += 1

    def pin(self, key: str) -> None:
        self._published(key).pin_count += 1

    def unpin(self, key: str) -> None:
        self._published(key).pin_count -= 1

    def reserve_queued(self, key: str) -> None:
        """A queue entry (or an iteration plan) assumes ``key`` stays resident."""
        e = self._published(key)
        e.queued_reservations += 1
        self._touch(e)

    def release_queued(self, key: str) -> None:
        e = self.catalog.get(key) or next((x for x in self._live if x.key == key and x.queued_reservations), None)
        if e is not None and e.queued_reservations:
            e.queued_reservations -= 1

    def touch(self, key: str) -> None:
        self._touch(self._published(key))

    def _published(self, key: str) -> Entry:
        e = self.catalog.get(key)
        if e is None:
            raise ResidencyError("E_RESIDENCY_NOT_PUBLISHED", f"adapter {key!r} has no published generation")
        return e

    # ---- launches --------------------------------------------------------------------

    def launch(self, handles, batch_generation=None) -> Launch:
        """Snapshot the handles one launch reads; every one must still be current."""
        handles = tuple(handles)
        stale = [h for h in handles if not self.is_current(h)]
        if stale:
            raise ResidencyError("E_RESIDENCY_STALE_GENERATION", "launch names stale handle(s) "
                                 f"{[(h.label, h.slot_id, h.slot_generation, h.pointer_generation) for h in stale]}; "
                                 "rebuild the plan from the requests' leases")
        for h in handles:
            self._used(self.slots[h.slot_id].entry)
        launch = Launch(self, handles, batch_generation, self.catalog_generation)
        self._launches = [l for l in self._launches if l.live]
        self._launches.append(launch)
        return launch

    # ---- eviction and retirement --------------------------------------------------------

    def evict(self, key: str) -> None:
        """Retire and reclaim ``key``'s published generation now; NotEvictable names the failing clauses."""
        e = self._published(key)
        reasons = self.ineligible(e)
        if reasons:
            raise NotEvictable(e.label, reasons)
        self._evict_now(e)

    def retire(self, key: str) -> None:
        """Stop new binds of ``key``'s generation; it is reclaimed once its fences pass (:meth:`collect`)."""
        e = self._published(key)
        self._move(e, S.RETIRING)
        del self.catalog[key]
        self.catalog_generation += 1
        self._log(f"retire {e.label}")
        self.collect()

    def collect(self) -> list[str]:
        """Reclaim retiring generations whose references, pins, reservations, device events and
        live launches are all gone. Returns the labels reclaimed."""
        live = self.live_generations()
        done = []
        for e in list(self._live):
            if (e.state is S.RETIRING and e.txn is None and not e.refcount and not e.pin_count
                    and not e.queued_reservations and not e.inflight_events() and (e.key, e.generation) not in live):
                self._reclaim(e)
                self.stats.reclaims += 1
                done.append(e.label)
        return done

    def replace(self, artifact: HostArtifact, *, slot: int | None = None) -> Handle:
        """Hotswap: stage ``artifact`` as a new generation of its key in a free slot,
        publish it in one catalog update, retire the old generation (reclaimed after its
        leases and last-use events). On failure the catalog still names the old generation."""
        self.host.put(artifact)
        return self.wait(self.begin(artifact.key, digest=artifact.digest, replace=True, slot=slot)).handle

    # ---- audit -----------------------------------------------------------------------

    def audit(self) -> dict[str, int]:
        """Prove ledger conservation and that page owners match entries, KV records and open
        transactions (raises LedgerError); returns the page counts by kind."""
        expected: dict[Owner, list[int]] = {}
        for e in self._live:
            if e.state in BINDABLE or (e.state is S.RETIRING and e.txn is None):
                expected[e.owner] = list(e.pages)
        for request, rec in self._kv.items():
            expected[Owner.kv(request)] = list(rec.pages)
        counts = self.pool.audit(expected, set(self._txns))
        for s in self.slots:
            if s.entry is not None and (s.entry.slot != s.id or s.entry not in self._live):
                raise LedgerError("E_LEDGER_OWNER_MISMATCH", f"slot {s.id} maps {s.entry.label}, which is not resident there")
        for key, e in self.catalog.items():
            if e.state not in BINDABLE or self.slots[e.slot].entry is not e:
                raise LedgerError("E_LEDGER_OWNER_MISMATCH", f"catalog names {e.label} in state {e.state.value}")
        return counts

    # ---- internals ----------------------------------------------------------------------

    def _log(self, msg: str) -> None:
        if self.trace is not None:
            self.trace.append(msg)

    def _touch(self, e: Entry) -> None:
        e.last_touch = next(self._clock)

    def _move(self, e: Entry, to: State) -> None:
        check_transition(e.label, e.state, to)
        e.state = to

    def _slot_pages(self, slot: int) -> list[int] | None:
        """The fixed ledger pages of ``slot`` (one arena: ``SlotStorage.slot_pages``), else None."""
        fixed = getattr(self.storage, "slot_pages", None)
        return fixed(slot) if fixed is not None else None

    def _usable(self, s: Slot) -> bool:
        """Free: no entry, no open transaction, last use complete, and (fixed pages) every page
        of the slot free in the ledger (not KV blocks)."""
        if s.entry is not None or s.txn is not None or not complete(s.last_use):
            return False
        pages = self._slot_pages(s.id)
        return pages is None or all(self.pool.owner(p) is None for p in pages)

    def _free_slot(self, wanted: int | None = None) -> Slot | None:
        if wanted is not None:
            s = self.slots[wanted]
            if not self._usable(s):
                raise ResidencyError("E_RESIDENCY_SLOT_BUSY", f"slot {wanted} is not free (an adapter, a transaction, "
                                     "unfinished device work or, in one arena, KV blocks on its pages)")
            return s
        # fixed pages: the top slots first, the ones KV blocks (taken lowest page first) reach last
        order = reversed(self.slots) if self._slot_pages(0) is not None else self.slots
        return next((s for s in order if self._usable(s)), None)

    def _new_entry(self, key: str, artifact: HostArtifact, generation: int | None = None) -> Entry:
        last = self._last_generation.get(key, 0)
        if generation is not None and generation <= last:
            raise ResidencyError("E_RESIDENCY_GENERATION", f"generation {generation} of {key!r} is not newer than {last}")
        gen = self._last_generation[key] = generation if generation is not None else last + 1
        e = Entry(key, artifact.digest, gen, artifact)
        self._move(e, S.HOST_READY)
        self._live.append(e)
        return e

    def _reserve_entry(self, e: Entry, slot: Slot, pages: list[int], txn_id: str) -> None:
        self._move(e, S.RESERVED)
        e.slot, e.pages, e.txn = slot.id, list(pages), txn_id

    def _copy(self, e: Entry, slot: Slot, attempt: int) -> tuple[Event, Event]:
        """Zero the slot views no whole-view piece covers, copy the pieces, record the copy-complete
        event (padded rank tails are zero: docs/design.md, Logical and physical rank), then
        ``mirror`` the copy (its failure fails the copy)."""
        self._move(e, S.LOADING)
        if not complete(slot.last_use):
            raise ResidencyError("E_RESIDENCY_REUSE_BEFORE_EVENT", f"slot {slot.id}'s last use has not completed")
        self.stats.load_attempts += 1
        self._log(f"copy {e.label} -> {e.pages}")
        views = self.storage.views(slot.id, e.pages)
        name = e.artifact.name
        issued, issued_cpu, issued_gc = time.perf_counter(), time.thread_time(), PAUSES.total()
        start = self.copier.mark()
        whole = {p.view for p in e.artifact.pieces if p.index == ()}
        with self.copier.side():  # one stream switch for the whole load (each costs host time)
            for view_name, v in views.items():
                if view_name not in whole:  # a whole-view piece writes every element of its view
                    self.copier.zero(v)
            for i, p in enumerate(e.artifact.pieces):
                self.copier.copy(views[p.view][p.index], p.src)
                if i == 0:
                    self.faults.check("copy", e.key, name, attempt)
            if not e.artifact.pieces:
                self.faults.check("copy", e.key, name, attempt)
            copied = self.copier.mark()
            # ordered after the copies: injected corruption, then validation's reads
            self.faults.corrupt_views(e.key, name, attempt, views, e.artifact.pieces)
            e.probe = self.prober.probe(slot.id, views)  # queued behind the copies: nothing waits at validation
        e.timing = (start, copied, self.copier.mark())
        self.stats.load_issue_seconds.append(time.perf_counter() - issued)
        self.stats.load_issue_cpu_seconds.append(time.thread_time() - issued_cpu)
        self.stats.load_issue_gc_seconds.append(PAUSES.total() - issued_gc)
        self.stats.h2d_bytes += e.artifact.nbytes
        copy_event = self.faults.event("copy", e.key, name, attempt, self.copier.record())
        e.events.append(copy_event)
        if self.mirror is not None:  # every rank holds the slot's bytes before anything can publish them
            self._log(f"mirror {e.label} slot {slot.id}")
            self.mirror(slot.id, e.key)
        return copy_event, self.faults.event("validate", e.key, name, attempt, DONE)

    def _publish_entry(self, e: Entry, slot: Slot, txn_id: str) -> None:
        slot.pointer_generation += 1
        slot.entry = e
        self.pool.move(e.pages, Owner.reserved(txn_id), e.owner)
        self._move(e, S.PUBLISHED)
        old = self.catalog.get(e.key)
        self.catalog[e.key] = e
        self.catalog_generation += 1
        self._log(f"publish {e.label} slot {slot.id} pages {e.pages}")
        if old is not None and old is not e and old.state in BINDABLE:
            self._move(old, S.RETIRING)  # replaced: no new binds; reclaimed after its fences
            self._log(f"retire {old.label}")

    def _drop_staged(self, e: Entry, slot: Slot) -> None:
        """Discard a never-published generation; its slot's generations advance."""
        e.events.clear()
        if e.state is not S.HOST_READY:
            self._move(e, S.HOST_READY)
        self._move(e, S.ABSENT)
        self._live.remove(e)
        e.txn = None
        slot.slot_generation += 1
        slot.pointer_generation += 1
        self._log(f"drop {e.label}")

    def _retire_victim(self, v: Entry, txn_id: str) -> Slot:
        self._move(v, S.RETIRING)
        if self.catalog.get(v.key) is v:
            del self.catalog[v.key]
            self.catalog_generation += 1
        slot = self.slots[v.slot]
        self._unmap(slot)
        slot.txn = v.txn = txn_id
        self._log(f"retire {v.label}")
        return slot

    def _unmap(self, slot: Slot) -> None:
        slot.entry = None
        slot.slot_generation += 1
        slot.pointer_generation += 1

    def _evict_now(self, e: Entry) -> None:
        self._move(e, S.RETIRING)
        if self.catalog.get(e.key) is e:
            del self.catalog[e.key]
            self.catalog_generation += 1
        self._reclaim(e)
        self.stats.evictions += 1

    def _reclaim(self, e: Entry) -> None:
        slot = self.slots[e.slot]
        if slot.entry is e:
            self._unmap(slot)
        self.pool.release(list(e.pages), e.owner)
        self._tombstone(e)

    def _tombstone(self, e: Entry) -> None:
        self._move(e, S.ABSENT)
        self._live.remove(e)
        e.txn = None
        self.tombstones.append((e.key, e.generation))
        self._log(f"tombstone {e.label}")
