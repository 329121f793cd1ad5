"""One engine over a tensor-parallel group: rank 0's messages to the other ranks, and their loop.

Owns the message protocol between rank 0 (the process that runs the engine: scheduler, bank
decisions, sampling, output) and the followers (ranks 1..N-1, each holding its part of the
model, its KV cache and its cut of every resident adapter), rank 0's side of it (:class:`Leader`,
:meth:`Leader.mirror`, :class:`LeaderBundleBank`) and the followers' loop (:func:`follow`);
docs/design.md, "The data path of a tensor-parallel job". Messages, broadcast by rank 0 over
the group's control channel::

    (gathers)                                   once, before Setup: every rank holds its weights,
                                                then each rank's GPU memory (``rank_memory``)
    Setup(...)                                  once: what rank 0 sized (KV blocks, slots, rank;
                                                with the joint ledger the arena's shape), and the
                                                bundle it serves with the three-stage operator,
                                                if any
    ("forward", inputs, row slots, hints)       every rank runs the same invocation of its part
                                                of the model, so the layers' all-reduces pair up
    ("capture", hints)                          every rank captures its decode graphs, every
                                                bucket in the same order (Setup.graph_seqs > 0)
    ("replay", inputs, row slots, bucket, hints)
                                                every rank refills and replays its graph of the
                                                bucket (a decode-only iteration rank 0 chose)
    ("load", slot, adapter id, hints)           every rank writes its cut of the adapter (a bundle
                                                member: its cores) into the slot, from its host
                                                cache or the disk, and reports; published only
                                                if all did
    ("stop",)                                   the follower returns its report (counters)

``hints``: the ids of the adapters whose host images rank 0's bank started building since the
last message (``Leader.hint``), riding on the message rank 0 sends anyway; each follower builds
its cut of them into its host cache on a background thread first (``cutcache.CutCache``).

Must not choose rows, slots or tokens: a follower does what rank 0 decided, in its order.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from mlora.batch.adapters.bundle_bank import BundleBank
from mlora.batch.adapters.bundles import pinned_bundle
from mlora.batch.adapters.catalog import AdapterError, PinnedAdapter
from mlora.batch.adapters.cutcache import CutCache, pinned_pool
from mlora.batch.adapters.residency import MirrorError
from mlora.batch.adapters.slots import BankError, SlotBank, TPShard, lru_slot
from mlora.batch.engine.executor import Inputs, run_model
from mlora.batch.engine.graphs import DecodeGraphs
from mlora.batch.errors import CodedError
from mlora.batch.model.arena import ArenaShape, SlotCarver
from mlora.batch.model.decoder import DTYPES, DecoderModel, ModelConfig, load_config
from mlora.batch.model.kvcache import KVCache
from mlora.batch.model.tp import TPLayout
from mlora.batch.model.tpgroup import LeadGroup, TPGroupError

FORWARD, LOAD, STOP = "forward", "load", "stop"
CAPTURE, REPLAY = "capture", "replay"


@dataclass(frozen=True)
class Setup:
    """What rank 0 decided before the first row, for every follower to build the same engine state."""

    num_blocks: int  # KV blocks on every rank (the same block ids everywhere)
    block_size: int
    num_slots: int  # adapter slots, or a bundle's core slots (0: no adapter is served)
    max_rank: int
    pinned: dict[str, PinnedAdapter]  # the servable adapters a load may name
    # a member's pin (the bundle's path and identity) when every rank serves that bundle with the
    # three-stage operator (BundleBank.for_rank, each rank verifying the bundle itself); None: slots
    bundle: PinnedAdapter | None = None
    bundle_operator: str = "torch"
    # decode graphs: rank 0's max_num_seqs (the graphs' buckets), 0 without graphs; every rank
    # then holds the graphs' scratch KV block and a Triton slot bank (graphs.DecodeGraphs)
    graph_seqs: int = 0
    # the bytes of each follower's host cache of its cuts: what rank 0's bank resolved for its own
    # (None: unbounded, 0: none, every mirrored load reads the adapter again)
    host_cache_bytes: int | None = 0
    # rank 0's pinned host blocks, in bytes (None: it pins none): a follower pins no more
    pinned_bytes: int | None = None
    # the joint memory ledger (--memory-ledger joint): rank 0's arena, rebuilt on every rank so that
    # KV block b and slot s are the same pages everywhere (num_blocks = its pages; spare page: the
    # graphs' scratch block); None: the KV cache and the slots have memory of their own
    arena: ArenaShape | None = None


class Leader:
    """Rank 0 of ``group`` (a ``tpgroup.LeadGroup``): sends the messages, runs its own part of
    each, and turns a failed collective into the group's failure (``E_TP_RANK_DIED``, ...)."""

    def __init__(self, group: LeadGroup):
        self.group = group
        self.collective = group.collective
        self.stopped = False
        self.reports: list | None = None  # what each follower returned (follow), once stopped
        self._hints: dict[str, None] = {}  # adapter ids for the next message's hints, in order

    def hint(self, p: PinnedAdapter) -> None:
        """Rank 0's bank started building ``p``'s host image ahead of use: the followers build
        theirs from the next message on (its ``hints``), with no message of its own."""
        self._hints[p.id] = None

    def _send(self, *msg) -> None:
        """Broadcast ``msg`` with the hints gathered since the last one."""
        hints, self._hints = tuple(self._hints), {}
        self.collective.broadcast_object((*msg, hints))

    def memory(self, device: torch.device) -> list[tuple[int, int, int] | None]:
        """Every rank's ``rank_memory``, measured once all ranks hold their weights (ranks that
        share a GPU then see what all their weights left), in rank order."""
        def both():
            self.collective.gather_objects(None)
            return self.collective.gather_objects(rank_memory(device))
        return self._guard(both)

    def setup(self, setup: Setup) -> None:
        self._guard(lambda: self.collective.broadcast_object(setup))

    def forward(self, x: Inputs, row_slots: list[int] | None, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Every follower runs the invocation ``x`` with ``row_slots``; ``run()`` is rank 0's."""
        def both():
            self._send(FORWARD, x, row_slots)
            return run()
        return self._guard(both)

    def capture(self, run: Callable[[], None]) -> None:
        """Every rank captures its decode graphs (``run()``: rank 0's), in lockstep: a capture's
        warm-up and captured forward hold the layers' all-reduces, which need every rank's."""
        def both():
            self._send(CAPTURE)
            run()
        self._guard(both)

    def replay(self, x: Inputs, row_slots: list[int] | None, bucket: int,
               run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Every follower replays its graph of ``bucket`` over ``x``; ``run()`` is rank 0's replay."""
        def both():
            self._send(REPLAY, x, row_slots, bucket)
            return run()
        return self._guard(both)

    def load(self, slot: int, p: PinnedAdapter, write: Callable[[], None]) -> None:
        """Every rank writes its cut of ``p`` into ``slot`` (``write()``: rank 0's); raises the
        first rank's error (an ``AdapterError`` fails the adapter's rows) unless all succeeded."""
        def everywhere():
            self._send(LOAD, slot, p.id)
            try:
                write()
                mine = None
            except CodedError as e:
                mine = _report(e)
            return self.collective.gather_objects(mine)
        reports = self._guard(everywhere)
        for rank, report in enumerate(reports):
            if report is not None:
                kind, code, message = report
                where = f"rank {rank} of {len(reports)}: " if rank else ""
                raise (AdapterError(code, where + message, p.id) if kind == "adapter"
                       else BankError(code, where + message))

    def mirror(self, slot: int, p: PinnedAdapter) -> None:
        """Every follower writes its cut of ``p`` into ``slot``, where rank 0's residency bank has
        just issued its own copy (``ResidencyBank.for_rank``); a follower's failure raises
        ``MirrorError``, which rolls rank 0's load transaction back (retried, then the
        adapter's rows fail with E_ADAPTER_LOAD, as a failed copy on one device)."""
        try:
            self.load(slot, p, lambda: None)
        except (AdapterError, BankError) as e:
            raise MirrorError(f"{e.code}: {e.message}") from e

    def stop(self) -> None:
        """Tell the followers to return and wait for them; raise their failure, if any."""
        if self.stopped:
            return
        self.stopped = True
        try:
            self.collective.broadcast_object((STOP,))
        except TPGroupError as e:
            raise self.group.failure(e) from e
        self.group.finish()
        self.reports = self.group.results()

    def abort(self, error: BaseException) -> BaseException:
        """The group stopped after rank 0's ``error``: the cause to raise (tpgroup.LeadGroup.failure)."""
        if self.stopped:
            return error
        self.stopped = True
        return self.group.failure(error)

    def _guard(self, fn):
        try:
            return fn()
        except TPGroupError as e:  # a follower died or failed: it is the cause
            raise self.abort(e) from e


def _report(e: CodedError) -> tuple[str, str, str]:
    return ("adapter" if isinstance(e, AdapterError) else "bank", e.code, e.message)


class LeaderBundleBank(BundleBank):
    """Rank 0's bundle bank: a member's cores loaded into a core slot are published only once
    every rank holds them there (``Leader.load``); a failed load leaves the slot empty on rank 0.
    With a core slot per member (the default) every core is resident from the start on every
    rank and no load happens."""

    leader: Leader

    def _load(self, member: int, p: PinnedAdapter, keep) -> None:
        slot = lru_slot(self._slot_of, self.num_slots, keep, self.stats)
        try:
            self.leader.load(slot, p, lambda: self.load_into(slot, p))
        except CodedError:
            self._slot_of.pop(member, None)
            raise


def rank_devices(device_type: str, size: int, one_gpu: bool = False) -> tuple[str, ...]:
    """Each rank's device: rank j on its own GPU (``cuda:j``), or the CPU; ``one_gpu``: every
    rank on ``cuda:0`` (a debugging run of the sharded kernels on one GPU, over gloo)."""
    if device_type != "cuda":
        return ("cpu",) * size
    return tuple(f"cuda:{0 if one_gpu else j}" for j in range(size))


def rank_memory(device: torch.device) -> tuple[int, int, int] | None:
    """(GPU index, free bytes, total bytes) of a rank's GPU, the allocator's cached blocks
    given back first; None on the CPU."""
    if device.type != "cuda":
        return None
    gc.collect()  # load temporaries held by reference cycles
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return device.index, free, total


def tp_graphs(backend: str, device_type: str) -> bool:
    """Whether a group's ranks can run decode graphs: on GPUs only over NCCL, whose all-reduces
    a CUDA graph captures (gloo's cannot be: a group over gloo on a GPU is a debugging run); on
    the CPU, where graphs are emulated (each replay re-runs the forward, gloo collectives included)."""
    return backend == "nccl" if device_type == "cuda" else True


class ModelSource(Protocol):
    """Where every rank of a group gets its part of one model: ``config`` is the whole model's,
    ``build`` returns the rank's part of it (``DecoderModel`` with ``tp=layout``). Every rank
    calls ``build`` at the same point, so a source may run collectives of its own on the group
    there. A source travels to the followers by pickle."""

    config: ModelConfig

    def build(self, device: torch.device, dtype: torch.dtype, layout: TPLayout, collective) -> DecoderModel: ...


@dataclass(frozen=True)
class Checkpoint:
    """A base checkpoint directory as a :class:`ModelSource`: each rank reads its slices of the files."""

    base: str

    @property
    def config(self) -> ModelConfig:
        return load_config(self.base)

    def build(self, device: torch.device, dtype: torch.dtype, layout: TPLayout, collective) -> DecoderModel:
        return DecoderModel.from_pretrained(self.base, device=device, dtype=dtype, tp=layout, collective=collective)


def model_source(source: ModelSource | str | os.PathLike) -> ModelSource:
    """``source`` as a :class:`ModelSource`: a base directory's path is its :class:`Checkpoint`."""
    return Checkpoint(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else source


def follow(collective, source: ModelSource | str, devices: tuple[str, ...], dtype_name: str,
           threads: int | None = None) -> dict:
    """A follower rank (``tpgroup`` calls it with the rank's ``collective``): build the rank's part of
    the model ``source`` gives (a base directory's path, or a :class:`ModelSource`) on
    ``devices[rank]`` (on the CPU with ``threads`` torch threads: rank 0's share of the cores),
    report its GPU memory, build the KV cache, bank (with its host cache of adapter cuts, as
    large as rank 0's) and decode graphs rank 0's ``Setup`` gives (with the joint ledger the
    KV cache and the slots over one arena of rank 0's shape), then run the messages until
    stop. Returns what rank 0 reads back at stop: its graph replays and buckets, its arena's
    pages, its mirrored loads and its host cache's counters (``CutCache.report``)."""
    layout = collective.layout
    device = torch.device(devices[layout.rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif threads:
        torch.set_num_threads(threads)
    source = model_source(source)
    model = source.build(device, DTYPES[dtype_name], layout, collective)
    collective.gather_objects(None)  # every rank holds its weights (Leader.memory)
    collective.gather_objects(rank_memory(device))
    setup: Setup = collective.broadcast_object()
    graphed = setup.graph_seqs > 0
    kv, carver = follower_memory(setup, model.config, model.dtype, device)
    bank = graphs = cache = None
    shard = TPShard(source.config, layout, collective)
    if setup.bundle is not None:
        bank = BundleBank.for_rank(pinned_bundle(setup.bundle), shard, model.dtype, device, pinned=setup.pinned,
                                   core_slots=setup.num_slots, operator=setup.bundle_operator)
    elif setup.num_slots:
        bank = SlotBank.for_rank(shard, setup.num_slots, setup.max_rank, model.dtype, device,
                                 backend="triton" if graphed else "auto", alloc=carver)
        block = bank.image_bytes()
        pool = (pinned_pool(setup.host_cache_bytes, block, len(setup.pinned), setup.pinned_bytes)
                if device.type == "cuda" else None)
        cache = bank.images = CutCache(setup.host_cache_bytes, bank.host_cut, block, pool)
    if graphed:
        graphs = DecodeGraphs(model, kv, bank, setup.graph_seqs, scratch_slot=setup.num_blocks * setup.block_size)
    loads = 0
    try:
        while True:
            msg = collective.broadcast_object()
            if msg[0] != STOP and msg[-1] and cache is not None:
                cache.hint(setup.pinned[i] for i in msg[-1] if i in setup.pinned)
            if msg[0] == FORWARD:
                _, x, row_slots, _ = msg
                run_model(model, kv, bank, x, row_slots)
            elif msg[0] == REPLAY:
                _, x, row_slots, bucket, _ = msg
                _replay(graphs, x, row_slots, bucket)
            elif msg[0] == CAPTURE:
                graphs.capture_all()
            elif msg[0] == LOAD:
                _, slot, adapter_id, _ = msg
                loads += 1
                try:
                    bank.load_into(slot, setup.pinned[adapter_id])
                    report = None
                except CodedError as e:
                    report = _report(e)
                collective.gather_objects(report)
            else:
                break
    finally:
        if cache is not None:
            cache.close()
    out = {"graph_replays": graphs.replays, "graph_buckets": len(graphs.graphs)} if graphed else {}
    if carver is not None:
        out["arena_pages"] = carver.arena.num_pages
    return out | ({"mirrored_loads": loads} | cache.report() if cache is not None else {})


def follower_memory(setup: Setup, config: ModelConfig, dtype: torch.dtype, device) -> tuple[KVCache, SlotCarver | None]:
    """A follower's KV cache of rank 0's block ids over the rank's kv heads (``config``: its
    part of the model), with one more block, owned by no sequence, for the decode graphs'
    padded rows; and the carver of its slots. With the joint ledger both come from one arena
    of rank 0's shape (the scratch block its spare page), so block b and slot s are rank 0's
    pages; else each has memory of its own (carver None)."""
    c = config
    carver = pages = None
    if setup.arena is not None:
        arena, carver = setup.arena.build(device)
        pages = arena.kv_pages(c.num_layers, setup.block_size, c.num_kv_heads, c.head_dim, dtype)
    kv = KVCache(c.num_layers, setup.num_blocks + int(setup.graph_seqs > 0), setup.block_size, c.num_kv_heads,
                 c.head_dim, dtype, device, pages=pages)
    return kv, carver


def _replay(graphs: DecodeGraphs | None, x: Inputs, row_slots: list[int] | None, bucket: int) -> None:
    """A follower's replay of rank 0's decode iteration ``x`` in ``bucket`` (its logits unread)."""
    if graphs is None or not graphs.fits(len(x.ids), max(len(t) for t in x.tables)) \
            or graphs.bucket(len(x.ids)) != bucket:
        raise CodedError("E_TP_PROTOCOL", f"rank 0 replays the decode graph of bucket {bucket} for "
                         f"{len(x.ids)} rows, which this rank's graphs do not match (a bug: both sides build "
                         "their graphs from the same Setup); run with --no-cuda-graphs and report it")
    graphs.run(x.ids, x.positions, x.slots, x.tables, x.context_lens, row_slots)
