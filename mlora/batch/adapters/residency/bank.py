"""The GPU slot bank on top of the residency engine: the slot bank's seam, residency's safety.

Owns the device tensors the segmented kernels read, in the layout of
``mlora.kernels.add_lora_slices`` (exactly as ``mlora.batch.adapters.slots.SlotBank``),
and the mapping from the engine's calls to residency transactions. Must not
know the model's layer code (``mlora.batch.model.lora`` is the seam) nor read
adapter files itself (``catalog.load_factors`` does, verified).

Per layer and group, with S slots, n slices and physical rank R::

    A       [S, n, R, d_in]            B       [S, sum(widths), R] (rank-pitched, as SlotBank's)
    ranks   int32   [n, S]             scales  float32 [n, S]

Only the groups named in ``shapes`` are allocated, and of each only the
slices in ``slices`` (a job whose adapters target q/v only needs no MLP slots
and no k slice: a slot is then exactly its adapter's factors, and a load's
whole-view image copies no zeros for untargeted modules). An adapter's host artifact is the list
of its factors (A into the leading rank rows; B as rank-pitched blocks of each
layer's flat ``B.<group>`` view, ``mlora.kernels.pitch``) plus its whole
ranks/scales columns; the slot is zeroed on the device first, so every tail
is zero and validation proves it (docs/design.md, Logical and physical rank).

Calls, as for SlotBank: ``ensure(ids, pinned) -> {id: slot}`` before each
model invocation, then ``context(row_slots)``. ``ensure`` closes the previous
invocation's launch (recording its last-use event) and holds every adapter
it returns as a queued reservation until ``context`` snapshots them; a miss
is loaded as a residency transaction (victims only among eligible slots,
rolled back and retried on failure, ``E_ADAPTER_LOAD`` after the budget).
Requests may also hold leases (``acquire``/``release``) so that a queued or
running request's adapter can never be evicted between iterations.

Rank 0 of a tensor-parallel group (:meth:`ResidencyBank.for_rank`): the images and
slots hold rank 0's cut of every adapter, and every copy into a slot is mirrored
(``mirror``) on the other ranks before the transaction can publish it
(docs/design.md, "The data path of a tensor-parallel job").
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from mlora.batch.adapters.catalog import AdapterError, PinnedAdapter, load_factors
from mlora.batch.adapters.residency.build import ProcessBuilder
from mlora.batch.adapters.residency.errors import AdapterLoadError, AdmissionError, ResidencyError, ValidationError
from mlora.batch.adapters.residency.events import Copier, copier_for
from mlora.batch.adapters.residency.faults import FaultInjector
from mlora.batch.adapters.residency.host import HostArtifact, HostCache, Piece
from mlora.batch.adapters.residency.manager import PER_LOAD_STATS, Handle, Launch, Residency
from mlora.batch.adapters.residency.pinned import PinnedPool
from mlora.batch.adapters.residency.pool import PagePool
from mlora.batch.adapters.residency.prefetch import HostPrefetcher
from mlora.batch.adapters.residency.states import BINDABLE, State
from mlora.batch.adapters.residency.storage import SlotStorage
from mlora.batch.adapters.slots import BankContext, SlotTensors, TPShard, rank_cut
from mlora.batch.model import arena as arena_mod
from mlora.batch.model.lora import GROUPS
from mlora.batch.model.tp import bank_shapes
from mlora.kernels import pitched_span

WHOLE_VIEW_RATIO = 2.0  # see SlotLayout.whole_views
DEFAULT_HOST_CACHE_IMAGES = 128  # host cache bound on a GPU without --host-cache-gb (images, in pinned blocks)
DEFAULT_PINNED_BYTES = 16 << 30  # and the default pool's bytes at most (pinned at start: ~2-7 GB/s)
PINNED_HEADROOM = 40  # pinned blocks beyond the cache's: builds and loads in flight, a hotswap's image


class BankError(ResidencyError):
    """The bank cannot place or serve an adapter (codes as SlotBank's: E_ADAPTER_UNKNOWN,
    E_BANK_RANK_EXCEEDS_R, E_BANK_SHAPE, E_BANK_FULL, E_BANK_SLOT_EMPTY, ...)."""


class ResidencyBank(SlotTensors):
    """``num_slots`` adapter slots for every (layer, group) in ``shapes``, managed by a :class:`Residency`."""

    error = BankError
    loads_ahead = True  # an AdapterBank (mlora.batch.adapters.protocol) that loads and builds ahead

    def __init__(self, num_layers: int, shapes: dict[str, tuple[int, tuple[int, ...]]], num_slots: int,
                 max_rank: int, dtype: torch.dtype, device, backend: str = "auto", *,
                 pool: PagePool | None = None, host_cache_bytes: int | None = None, max_load_attempts: int = 3,
                 faults: FaultInjector | None = None, copier: Copier | None = None, trace: bool = False,
                 prefetch_workers: int = 1, build_processes: int = 0, expected_adapters: int | None = None,
                 pinned_pool: PinnedPool | None = None, slices: dict[str, tuple[int, ...]] | None = None,
                 arena=None, tp: TPShard | None = None, mirror: Callable[[int, PinnedAdapter], None] | None = None,
                 hint: Callable[[PinnedAdapter], None] | None = None):
        """``arena`` (an ``arena.PageArena``): the slots are carved from the top of its pages and
        the residency engine's ledger is its pages (KV blocks and adapters draw from one pool:
        ``residency.reserve_kv`` / ``grow_kv``); default: slots of their own, a ledger of one
        page per slot. ``tp``: the slots hold that rank's cut of every adapter (:meth:`for_rank`);
        ``mirror(slot, pinned)``: called right after each copy into a slot is issued, on the
        engine thread (``Residency(mirror=...)``); ``hint(pinned)``: called when :meth:`prefetch`
        starts building an adapter's host image (rank 0 of a group: the followers build theirs)."""
        if not shapes or not set(shapes) <= set(GROUPS):
            raise ValueError(f"shapes must describe some of the groups {sorted(GROUPS)}, got {sorted(shapes)}")
        groups = tuple(g for g in GROUPS if g in shapes)
        self.slot_bytes = self.bytes_per_slot(num_layers, {g: shapes[g] for g in groups}, max_rank, dtype, slices)
        carver = None
        if arena is not None:
            if pool is not None:
                raise ValueError("a bank over an arena keeps the arena's own ledger; pass no pool")
            pps = self.arena_pages_per_slot(self.slot_bytes, len(groups), arena.page_bytes)
            carver = arena.carver(num_slots, pps)
            pool = PagePool(arena.num_pages, arena.page_bytes)
        super().__init__(num_layers, shapes, groups, num_slots, max_rank, dtype, device, backend, slices, alloc=carver)
        self._shard(tp)
        self.arena = arena
        if pool is None:
            pool = PagePool(num_slots, self.slot_bytes)
        tensors = {}
        for g in self.groups:
            # B per slot and layer as one flat run: a rank-pitched slice is a contiguous range of it
            tensors.update({f"A.{g}": (self.A[g], 0), f"B.{g}": (self.B[g].flatten(2), 0),
                            f"ranks.{g}": (self.ranks[g], 0), f"scales.{g}": (self.scales[g], 0)})
        if carver is not None:
            storage = SlotStorage(tensors, carver.pages_per_slot, self._check_meta, first_page=carver.first_page)
        else:
            storage = SlotStorage(tensors, math.ceil(self.slot_bytes / pool.page_bytes), self._check_meta)
        self.layout = SlotLayout(self.num_layers, self.groups, self.widths, self.d_in, self.offsets, max_rank, dtype,
                                 {n: (tuple(t.select(d, 0).shape), t.dtype) for n, (t, d) in tensors.items()},
                                 self.slice_index, (tp.config, tp.layout) if self.tp is not None else None)
        copier = copier or copier_for(self.device)
        self.pinned_pool = pinned_pool  # given: tests stage images through unpinned blocks on the CPU
        if pinned_pool is None and self.device.type == "cuda":
            # every host image lives in a block pinned here, before the first row: pinning while
            # the job runs stalls the engine thread's CUDA calls (pinned.py). Blocks: the host
            # cache's images (default bound DEFAULT_HOST_CACHE_IMAGES) and headroom for builds
            # and loads in flight (a published adapter keeps no image: HostArtifact.header);
            # never more than the job's adapters need. An image that finds no free block stays
            # pageable (counted).
            block = self.layout.max_image_bytes()
            default = host_cache_bytes is None
            if default:
                host_cache_bytes = DEFAULT_HOST_CACHE_IMAGES * block
            blocks = host_cache_bytes // block + PINNED_HEADROOM
            if expected_adapters is not None:
                blocks = min(blocks, expected_adapters + PINNED_HEADROOM)
            if default:  # large adapters: bounded start-up pinning (images beyond stay pageable, counted)
                blocks = min(blocks, max(1, DEFAULT_PINNED_BYTES // block))
            self.pinned_pool = PinnedPool(block, blocks, fence=copier.record)
        host = HostCache(host_cache_bytes, pin=self.pinned_pool is not None, pool=self.pinned_pool)
        self._mirror_to, self._hint = mirror, hint
        self._sources: dict[str, PinnedAdapter] = {}  # key -> the pinned adapter its host source reads
        self.residency = Residency(storage, pool, host, copier=copier, faults=faults,
                                   max_load_attempts=max_load_attempts, trace=trace,
                                   mirror=self._mirror if mirror is not None else None)
        for s in range(num_slots):  # each slot's probe buffers now, not inside its first load (GPU)
            self.residency.prober.prepare(s, storage.views(s, []))
        self.stats = self.residency.stats
        self.prefetcher = HostPrefetcher(host, prefetch_workers) if prefetch_workers > 0 else None
        # host images built in worker processes: the engine thread shares no interpreter lock with them
        self.builder = ProcessBuilder(build_processes) if build_processes > 0 and self.prefetcher is not None else None
        if self.builder is not None:
            self.builder.start()
        self._plan: list[str] = []  # keys the last ensure() returned, held until context()
        self._open: ResidencyContext | None = None
        # loads started ahead (admission's asynchronous loads, GPU-tier prefetch): key -> (adapter id, txn)
        self._device_loads: dict[str, tuple[str, object]] = {}
        self._async_failed: set[str] = set()  # keys whose asynchronous load failed: load them the blocking way
        self.loads_started_ahead = 0  # by start_load and prefetch_device
        self._builds_requested: set[str] = set()  # host images start_load asked the prefetcher for

    @classmethod
    def for_rank(cls, tp: TPShard, num_slots: int, max_rank: int, dtype: torch.dtype, device,
                 mirror: Callable[[int, PinnedAdapter], None], **kw) -> ResidencyBank:
        """Rank 0's bank of a tensor-parallel group: slots of every group at the shapes of the
        rank's cut (``tp.bank_shapes``, as the followers' ``SlotBank.for_rank``: each rank's
        slot s holds its cut of the same adapter), every copy mirrored on the followers."""
        return cls(tp.config.num_layers, bank_shapes(tp.config, tp.layout)[0], num_slots, max_rank, dtype, device,
                   tp=tp, mirror=mirror, **kw)

    @staticmethod
    def arena_pages_per_slot(slot_bytes: int, groups: int, page_bytes: int) -> int:
        """Arena pages of one slot (``--memory-ledger joint``): four tensors per group (A, B,
        ranks, scales), each aligned inside the slot's pages (``arena.pages_per_slot``)."""
        return arena_mod.pages_per_slot(slot_bytes, 4 * groups, page_bytes)

    @property
    def resident(self) -> dict[str, int]:
        """semantic_sha256 -> slot of every published adapter, least recently used first."""
        entries = sorted(self.residency.catalog.values(), key=lambda e: e.last_touch)
        return {e.key: e.slot for e in entries}

    # ---- the step-3 seam ------------------------------------------------------------------

    def ensure(self, adapter_ids: list[str], pinned: dict[str, PinnedAdapter]) -> dict[str, int]:
        """Make every listed adapter's generation published and return adapter id -> slot.

        Raises BankError for an unknown or unservable id, a rank above the bank's or
        more distinct adapters than slots; AdapterChanged when an adapter's bytes
        changed; ArtifactRefused (E_VALIDATE_*) for an adapter refused before any eviction;
        AdapterLoadError (E_ADAPTER_LOAD) when every load attempt failed -- in each
        case the failed adapter's attempts were rolled back (victims restored)."""
        self._end_invocation()
        res = self.residency
        wanted: OrderedDict[str, PinnedAdapter] = OrderedDict()
        for adapter_id in adapter_ids:
            p = self._check(adapter_id, pinned)
            wanted.setdefault(p.semantic_sha256, p)
        if len(wanted) > self.num_slots:
            raise BankError("E_BANK_FULL", f"{len(wanted)} distinct adapters requested at once, the bank has "
                            f"{self.num_slots} slots; the scheduler must admit at most that many (raise "
                            "--max-gpu-adapters or lower --max-num-seqs)")
        for key, p in wanted.items():
            self._make_resident(key, p)
            res.reserve_queued(key)  # this invocation's plan assumes it stays resident
            self._plan.append(key)
        return {i: res.catalog[pinned[i].semantic_sha256].slot for i in adapter_ids}

    def context(self, row_slots: torch.Tensor, static=None) -> "ResidencyContext":
        """The LoraContext of one model invocation; snapshots the handles of every slot it
        names as a launch (live until the next ``ensure``/``context`` or ``ctx.close()``).
        ``static``: the LaunchPlan buffers of a captured CUDA graph to fill."""
        self._close_launch()
        row_slots, plan, kernel_plan = self._plans(row_slots, static)
        active = plan.slot_ids.tolist()
        handles, stray = [], []
        for s in active:
            e = self.residency.slots[s].entry if 0 <= s < self.num_slots else None
            if e is None or not (e.state in BINDABLE or (e.state is State.RETIRING and e.refcount)):
                stray.append(s)
            else:
                handles.append(self.residency.handle_of(e))
        if stray:
            raise BankError("E_BANK_SLOT_EMPTY", f"row_slots name slots {stray} that hold no "
                            "published adapter; call ensure() for this invocation's adapters first")
        launch = self.residency.launch(handles)
        self._release_plan()  # the launch snapshot protects them now
        targeted = frozenset().union(*(self.residency.slots[h.slot_id].entry.artifact.meta["targets"]
                                       for h in handles))
        self._open = ResidencyContext(self, row_slots, kernel_plan, targeted, launch)
        return self._open

    def prefetch(self, adapter_ids: list[str], pinned: dict[str, PinnedAdapter]) -> int:
        """Start building, in the background, the verified host images of the listed
        adapters that are neither published nor cached (``residency.prefetch``); returns
        how many builds started. Ids that cannot be served are skipped: their rows fail
        where they always do, at load. Host tier only: no slot, page or copy is taken."""
        if self.prefetcher is None:
            return 0
        self.prefetcher.collect()
        started = 0
        for adapter_id in adapter_ids:
            p = self._loadable(adapter_id, pinned)
            if p is None:
                continue
            key = p.semantic_sha256
            if self.residency.catalog.get(key) is not None:
                continue
            self._register(key, p)
            if self.prefetcher.request(key, build=lambda p=p: self._prefetch_artifact(p)):
                started += 1
                if self._hint is not None:
                    self._hint(p)
        return started

    def prefetch_device(self, adapter_ids: list[str], pinned: dict[str, PinnedAdapter], limit: int) -> int:
        """Start GPU-tier loads of up to ``limit`` of the listed adapters (in order), copying on
        the side stream while the current iteration runs (``Residency.prefetch``: the same
        transaction, ledger, validation and publication as a demand load). Only adapters
        whose verified host image is already cached (never a build here), and only into a
        free slot or the slot of an adapter that no waiting row names (the ``want`` hint),
        so a prefetch never evicts what the queue still needs. Returns how many started;
        :meth:`commit_device` (or an ``ensure`` that needs one) commits them."""
        res = self.residency
        started = 0
        for adapter_id in adapter_ids:
            if started >= limit:
                break
            p = self._loadable(adapter_id, pinned)
            if p is None:
                continue
            key = p.semantic_sha256
            if res.catalog.get(key) is not None or res.loading(key) is not None or not res.host.cached(key):
                continue
            if res.free_slot() is None and not any(e.key not in res.wanted for e in res.eligible_victims()):
                break  # every slot holds an adapter in use or still wanted
            try:
                txn = res.prefetch(key)
            except ResidencyError:  # no room now, or refused: the demand load decides (and raises)
                break
            if txn is not None:
                self._device_loads[key] = (adapter_id, txn)
                self.loads_started_ahead += 1
                started += 1
        return started

    def start_load(self, adapter_id: str, pinned: dict[str, PinnedAdapter]) -> str:
        """Start loading one adapter the scheduler admits, without waiting for it (a cold
        adapter is load-eligible, its rows run once its generation is published).
        The transaction is an ordinary demand load (victims: any eligible slot, LRU, those
        no waiting row names first) whose copy overlaps the device work already queued;
        :meth:`commit_device` (or an ``ensure`` that needs it) validates and publishes it.

        Returns "resident" (nothing to do), "loading" (already started), "started",
        "building" (its host image is being built in the background, asked for now if
        need be: ask again later), "no-room" (no slot can be freed now) or "sync": load it
        the blocking way, through ``ensure`` (no prefetcher, its requested build failed,
        an earlier asynchronous attempt failed, or the adapter is refused), so retries and
        errors follow the demand path."""
        p = self._loadable(adapter_id, pinned)
        if p is None:
            return "sync"
        key, res = p.semantic_sha256, self.residency
        if res.catalog.get(key) is not None:
            return "resident"
        if key in self._device_loads or res.loading(key) is not None:
            return "loading"
        if key in self._async_failed:
            return "sync"
        if not res.host.cached(key) and self.prefetcher is not None:
            self.prefetcher.collect()
        if not res.host.cached(key):
            if self.prefetcher is None:
                return "sync"
            if self.prefetcher.building(key):
                return "building"
            if key in self._builds_requested:  # requested here before, and its build failed (or was
                return "sync"                  # dropped): the blocking path raises or rebuilds
            self._builds_requested.add(key)
            return "building" if self.prefetch([adapter_id], pinned) else "sync"
        self._builds_requested.discard(key)
        try:
            txn = res.begin(key)
        except AdmissionError:
            return "no-room"
        except (ResidencyError, AdapterError):  # refused or rolled back: the blocking path raises and retries
            self._async_failed.add(key)
            return "sync"
        self._device_loads[key] = (adapter_id, txn)
        self.loads_started_ahead += 1
        return "started"

    def load_now(self, adapter_id: str, pinned: dict[str, PinnedAdapter]) -> bool:
        """Make one adapter resident now, the blocking way, outside any invocation (the joint
        memory mode's admission, where a load must hold its slot's pages before later rows'
        KV can take them). False when no slot can be had now (AdmissionError: nothing
        changed); the load's own errors propagate as ``ensure``'s would."""
        p = self._check(adapter_id, pinned)
        try:
            self._make_resident(p.semantic_sha256, p)
        except AdmissionError:
            return False
        return True

    def loads_in_flight(self) -> int:
        return len(self._device_loads)

    def end_invocation(self) -> None:
        """The previous invocation's device work has completed (the engine read its tokens):
        close its launch now, so its adapters that no row uses any more can be evicted by
        the loads the next admission starts (``ensure`` would close it anyway)."""
        self._end_invocation()

    def commit_device(self) -> list[tuple[str, float]]:
        """Wait for every load started ahead (``start_load``, ``prefetch_device``) and commit
        it (validation, then publication); returns (adapter id, seconds the caller waited for
        it: the part of the load that did not overlap device work) of each. One that fails
        validation is rolled back (victims restored) and dropped: the adapter's next load
        goes the blocking way, with that load's retries and errors."""
        done = []
        for key, (adapter_id, txn) in list(self._device_loads.items()):
            del self._device_loads[key]
            t0 = time.perf_counter()
            try:
                self.residency.wait(txn)
            except ResidencyError:  # rolled back; the adapter's next load goes the blocking way
                self._async_failed.add(key)
                continue
            done.append((adapter_id, time.perf_counter() - t0))
        return done

    def want(self, adapter_ids, pinned: dict[str, PinnedAdapter]) -> None:
        """The adapters queued rows still name: eviction takes the others first (LRU within
        each class). A ranking hint only: eligibility (docs/design.md, Eviction eligibility) is unchanged."""
        self.residency.wanted = frozenset(pinned[a].semantic_sha256 for a in adapter_ids
                                          if a in pinned and pinned[a].semantic_sha256)

    def source_tier(self, adapter_id: str, pinned: dict[str, PinnedAdapter]) -> str:
        """Where a load of ``adapter_id`` would copy from now: "device" (published),
        "host" (its verified image is in the host cache) or "disk"."""
        p = pinned.get(adapter_id)
        if p is None or not p.ok:
            return "disk"
        if self.residency.catalog.get(p.semantic_sha256) is not None:
            return "device"
        if self.prefetcher is not None:
            self.prefetcher.collect()
        return "host" if self.residency.host.cached(p.semantic_sha256) else "disk"

    def prefetch_counts(self) -> tuple[int, int]:
        """(host images built ahead, of those used by a load) over the bank's life."""
        pf = self.prefetcher
        return (pf.issued, pf.used) if pf is not None else (0, 0)

    def report(self) -> dict:
        """The counters (without per-load timings); per load, the mean, median and 90th
        percentile in ms of the copy stream's time (copies and validation reads; the copies
        alone) and of the host's time to issue it (wall, CPU, collector pauses inside it);
        the loads whose issue contained a collection (in any thread); loads started ahead;
        the pinned pool's and the image build processes' figures."""
        stats = self.stats
        out = {k: v for k, v in stats.as_dict().items() if k not in PER_LOAD_STATS}
        for name, field in (("load_device", "load_device_seconds"), ("load_copy", "load_copy_seconds"),
                            ("load_issue", "load_issue_seconds"), ("load_issue_cpu", "load_issue_cpu_seconds"),
                            ("load_issue_gc", "load_issue_gc_seconds")):
            times = sorted(getattr(stats, field))
            if times:
                out.update({f"{name}_ms_mean": round(1e3 * sum(times) / len(times), 4),
                            f"{name}_ms_p50": round(1e3 * times[(len(times) - 1) // 2], 4),
                            f"{name}_ms_p90": round(1e3 * times[int(0.9 * (len(times) - 1))], 4)})
        if stats.load_issue_gc_seconds:
            out["load_issues_with_gc"] = sum(1 for t in stats.load_issue_gc_seconds if t > 0)
        out["loads_started_ahead"] = self.loads_started_ahead
        if self.pinned_pool is not None:
            out.update(self.pinned_pool.stats())
        if self.builder is not None:
            b = self.builder
            out.update(images_built_in_workers=b.built, image_worker_failures=b.failed,
                       image_worker_seconds=round(b.worker_s, 3), image_round_trip_seconds=round(b.round_trip_s, 3),
                       image_receive_seconds=round(b.receive_s, 3))
        return out

    def close(self) -> None:
        """Stop the prefetch threads (builds in flight are finished or cancelled)."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.builder is not None:
            self.builder.close()

    # ---- leases ------------------------------------------------------------------------

    def acquire(self, request: str, adapter_id: str, pinned: dict[str, PinnedAdapter]) -> Handle:
        """Load if needed and bind request attempt ``request`` to the adapter's current
        generation for its lifetime (its slot cannot be evicted until :meth:`release`)."""
        p = self._check(adapter_id, pinned)
        self._make_resident(p.semantic_sha256, p)
        return self.residency.acquire(request, p.semantic_sha256)

    def release(self, request: str) -> None:
        self.residency.finish_request(request)

    # ---- internals ----------------------------------------------------------------------

    def _make_resident(self, key: str, p: PinnedAdapter) -> None:
        res = self.residency
        self._register(key, p)
        pending = res.loading(key)
        if pending is not None and res.catalog.get(key) is None:  # a load started ahead, in flight
            self._device_loads.pop(key, None)  # committed here: this invocation counts it as its load
            try:
                res.wait(pending)
            except ResidencyError:
                pass  # rolled back: loaded below, the blocking way (with retries)
        if res.catalog.get(key) is not None:
            res.stats.hits += 1
            res.touch(key)
            return
        res.stats.misses += 1
        try:
            res.load(key)
        except AdapterLoadError as exc:
            raise AdapterLoadError(p.id, exc.attempts, exc.last) from exc.last

    def _register(self, key: str, p: PinnedAdapter) -> None:
        """``p``'s verified host source under ``key``, once."""
        if not self.residency.host.has_source(key):
            self.residency.host.register(key, key, lambda p=p: self._artifact(p))
        self._sources.setdefault(key, p)

    def _mirror(self, slot: int, key: str) -> None:
        self._mirror_to(slot, self._sources[key])

    def _loadable(self, adapter_id: str, pinned: dict[str, PinnedAdapter]) -> PinnedAdapter | None:
        """The pinned record of an adapter these slots can hold, or None (unknown, unservable,
        or above the bank's rank: the blocking path names the error)."""
        p = pinned.get(adapter_id)
        return p if p is not None and p.ok and p.max_rank <= self.max_rank else None

    def _artifact(self, p: PinnedAdapter) -> HostArtifact:
        """The verified host image of one pinned adapter, built on this thread."""
        return self.layout.artifact(p)

    def _prefetch_artifact(self, p: PinnedAdapter) -> HostArtifact:
        """The verified host image of one pinned adapter for the prefetcher: built in a worker
        process when the bank has them (``build.ProcessBuilder``), else on the calling
        thread. A worker's failure is not trusted to explain itself: the image is then
        built here, which raises the error a synchronous load would."""
        if self.builder is not None:
            art = self.builder.build(self.layout, p, pin=self.residency.host.pin, pool=self.pinned_pool)
            if art is not None:
                return art
        return self._artifact(p)

    def _check_meta(self, views: dict[str, torch.Tensor], name: str) -> None:
        """Ranks within [0, R]; scales finite, and zero wherever the rank is zero."""
        for g in self.groups:
            r, s = views.get(f"ranks.{g}"), views.get(f"scales.{g}")
            if r is None or s is None:
                continue
            # numpy on the host copies: a handful of tiny torch ops would cost the engine thread far
            # more per load than numpy's microseconds
            r, s = r.to("cpu").numpy(), s.to("cpu", torch.float32).numpy()
            if ((r < 0) | (r > self.max_rank)).any():
                raise ValidationError("E_VALIDATE_LAYOUT", f"adapter {name!r}: ranks of group {g} outside "
                                      f"[0, {self.max_rank}]")
            if not np.isfinite(s).all() or (s[r == 0] != 0).any():
                raise ValidationError("E_VALIDATE_SCALE", f"adapter {name!r}: malformed scaling metadata in group "
                                      f"{g} (non-finite, or a scale on a slice the adapter does not target); the "
                                      "adapter is refused")

    def _release_plan(self) -> None:
        for key in self._plan:
            self.residency.release_queued(key)
        self._plan = []

    def _close_launch(self) -> None:
        if self._open is not None:
            self._open.close()
            self._open = None

    def _end_invocation(self) -> None:
        self._close_launch()
        self._release_plan()


class SlotLayout:
    """What the host image of an adapter must look like for a bank's slots, and how to build
    it: the checks of ``SlotTensors._place``, the factors in the leading rank
    rows/columns, whole slot views where they are compact enough. Picklable (plain
    attributes), so worker processes build images exactly as the bank would."""

    error = BankError
    _place = SlotTensors._place  # the same checks, on these attributes

    def __init__(self, num_layers: int, groups, widths: dict, d_in: dict, offsets: dict, max_rank: int,
                 dtype: torch.dtype, view_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 slice_index: dict[str, dict[int, int]], cut: tuple | None = None):
        """``cut``: (the whole base's config, a ``TPLayout``): images of that rank's cut of each adapter."""
        self.cut = cut
        self.num_layers, self.groups, self.widths, self.d_in = num_layers, tuple(groups), dict(widths), dict(d_in)
        self.offsets, self.max_rank, self.dtype, self.view_shapes = dict(offsets), max_rank, dtype, dict(view_shapes)
        self.slice_index = {g: dict(m) for g, m in slice_index.items()}  # group slice -> bank slice

    def artifact(self, p: PinnedAdapter) -> HostArtifact:
        """The verified host image of one pinned adapter (factors re-hashed from disk)."""
        L = self.num_layers
        ranks = {g: torch.zeros(L, len(self.widths[g]), dtype=torch.int32) for g in self.groups}
        scales = {g: torch.zeros(L, len(self.widths[g]), dtype=torch.float32) for g in self.groups}
        pieces, targets = [], set()
        factors = sorted(load_factors(p, self.dtype, "cpu").items())
        if self.cut is not None:
            factors = rank_cut(factors, *self.cut)
        for layer, group, j, a, b, r, scale in self._place(p, factors):
            off, w = self.offsets[group][j], self.widths[group][j]
            pieces.append(Piece(f"A.{group}", (layer, j, slice(0, r)), a.contiguous()))
            span, p_r = pitched_span(off, w, r, self.max_rank)  # rank-pitched: a [w, p_r] block
            block = torch.zeros(w, p_r, dtype=b.dtype)
            block[:, :r] = b
            pieces.append(Piece(f"B.{group}", (layer, span), block.reshape(-1)))
            ranks[group][layer, j] = r
            scales[group][layer, j] = scale
            targets.add((layer, group))
        for g in self.groups:
            pieces += [Piece(f"ranks.{g}", (), ranks[g]), Piece(f"scales.{g}", (), scales[g])]
        pieces = self.whole_views(pieces) or pieces
        art = HostArtifact(p.semantic_sha256, p.semantic_sha256, pieces, name=p.id,
                           meta={"targets": frozenset(targets), "artifact_sha256": p.artifact_sha256})
        art.view_checks(self.view_shapes)  # here, where the image is built, not at validation
        return art

    def max_image_bytes(self) -> int:
        """An upper bound on the packed size of any image :meth:`artifact` builds (each piece
        64-byte aligned): every slot view whole, plus the alignment of the most pieces a
        piecewise image can have (A and B per layer and slice, ranks and scales per group)."""
        whole = sum(-(-math.prod(shape) * torch.empty((), dtype=dt).element_size() // 64) * 64
                    for shape, dt in self.view_shapes.values())
        pieces = 2 * self.num_layers * sum(len(self.widths[g]) for g in self.groups) + 2 * len(self.groups)
        return whole + 64 * pieces

    def whole_views(self, pieces: list[Piece]) -> list[Piece] | None:
        """The same slot contents as one piece per slot view, the view's whole image (zeros,
        then the pieces), when those images hold at most ``WHOLE_VIEW_RATIO`` times the bytes
        of the pieces; else None (the pieces stay: e.g. rank-8 adapters in rank-64 slots, or
        an adapter that targets few of the bank's groups).

        Whole views make a load a handful of large copies instead of two per targeted
        module (128 for a q/v adapter of a 32-layer model), with nothing to zero first:
        fewer calls on the engine thread per load."""
        compact = sum(p.src.numel() * p.src.element_size() for p in pieces)
        whole = sum(math.prod(shape) * torch.empty((), dtype=dt).element_size()
                    for shape, dt in self.view_shapes.values())
        if whole > WHOLE_VIEW_RATIO * compact:
            return None
        images = {n: torch.zeros(shape, dtype=dt) for n, (shape, dt) in self.view_shapes.items()}
        for p in pieces:
            images[p.view][p.index] = p.src
        return [Piece(n, (), image) for n, image in images.items()]


class ResidencyContext(BankContext):
    """``mlora.batch.model.lora.LoraContext`` over a ResidencyBank for one invocation (``apply``
    as BankContext's; ranks were validated when published, row slots in ``context()``),
    plus the launch snapshot that keeps its slots from being reclaimed."""

    def __init__(self, bank: ResidencyBank, row_slots: torch.Tensor, plan, targeted: frozenset, launch: Launch):
        super().__init__(bank, row_slots, plan, targeted)
        self.launch = launch

    def close(self, event=None) -> None:
        """The invocation's kernels are issued: its last-use event is ``event`` (default: one
        recorded now on the compute stream)."""
        if self.launch.event is None:
            self.launch.finish(event if event is not None else self.bank.residency.copier.compute_event())
