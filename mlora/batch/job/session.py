"""One engine on one device: the unit every way of running a job repeats.

Owns building the model, the adapter bank and the engine from a job's
options and the adapters it pinned (:class:`EngineSession`), turning input
rows into engine requests (:func:`requests_of`) and finished rows into output
records (:func:`result_record`). The single-process job (``runner.py``), each
worker process of ``--gpus`` / ``--num-workers`` (``scaleout/worker.py``) and
each Ray actor (``scaleout/ray.py``) build one session each and call the same
functions, so a row's output does not depend on which of them ran it.

Must not know where rows come from or where records go, and never pins
adapters: a session serves exactly the identities the job pinned at start
(the bank re-hashes factors when it loads them, ``E_ADAPTER_CHANGED``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator

import torch

from mlora.batch.adapters.bundle_bank import BundleBank
from mlora.batch.adapters.bundles import pinned_bundle
from mlora.batch.adapters.catalog import PinnedAdapter
from mlora.batch.adapters.residency import ResidencyBank
from mlora.batch.adapters.slots import TPShard
from mlora.batch.config import JobConfig
from mlora.batch.engine.engine import Decoding, Engine, Request, Result
from mlora.batch.engine.sampling import SamplingParams
from mlora.batch.engine.tpfollow import Leader, LeaderBundleBank, Setup, follow, rank_devices, tp_graphs
from mlora.batch.errors import JobError, ModelError
from mlora.batch.gcpauses import RunPauses
from mlora.batch.job.chat import ChatMessagesError
from mlora.batch.job.metrics import JobMetrics
from mlora.batch.job.prepare import BASE_IDS, Tokenizer
from mlora.batch.job.sizing import adapter_share_bytes, decode_graphs, joint_arena, kv_blocks, num_slots, rank_usable
from mlora.batch.model.arena import ArenaShape
from mlora.batch.model.decoder import DTYPES, DecoderModel, load_config
from mlora.batch.model.lora import held_slices
from mlora.batch.model.tp import TPLayout, bank_shapes, check_size
from mlora.batch.model.tpgroup import LeadGroup


class EngineSession:
    """Model + adapter bank + engine for ``opts`` on ``device``.

    ``pinned`` maps every adapter id the session may see to its
    :class:`PinnedAdapter` (bad ones included: their rows become error rows).
    The bank serves the members of one bundle with the three-stage operator
    (:func:`served_bundle`), or every servable adapter through residency slots,
    or nothing when no adapter is servable. ``metrics`` (a
    :class:`~mlora.batch.job.metrics.JobMetrics`) is created after the model and
    the preloaded adapters are in place, so its clock measures generation only."""

    def __init__(self, opts: JobConfig, pinned: dict[str, PinnedAdapter], device: torch.device, dtype: torch.dtype):
        self.opts, self.pinned, self.device, self.dtype = opts, pinned, device, dtype
        self.tokenizer = Tokenizer.for_job(opts)
        self.arena = None  # the joint memory ledger's page arena
        self._switch = None  # the GIL switch interval to restore at close
        good = {a: p for a, p in pinned.items() if p.ok}
        bundle = served_bundle(opts, good)
        self.tp = None  # rank 0 of the tensor-parallel group (engine/tpfollow.py), or None
        self._tp_graphs = False  # whether the group's ranks run decode graphs
        if opts.tensor_parallel_size > 1:
            self._tensor_parallel(good, bundle)
            return
        self.model = DecoderModel.from_pretrained(opts.base, device=device, dtype=dtype)
        if bundle is not None:
            self.bank = self._bundle_bank(bundle, good)
        elif good:
            self.bank = self._residency_bank(good)
            if opts.preload_adapters:
                self._preload(good)
        else:
            self.bank = None
        self.metrics = JobMetrics()
        self.engine = self._engine()
        self.pauses = RunPauses()  # the collector's pauses from here on
        self.pauses.start()

    def _tensor_parallel(self, good: dict[str, PinnedAdapter], bundle) -> None:
        """The engine as rank 0 of ``--tensor-parallel-size`` ranks (docs/scaleout.md): followers
        started, this rank's part of the model, a residency bank of its adapter cuts whose
        copies the followers mirror or a slot bank of a bundle's bases (``LeaderBundleBank``),
        the KV blocks and slots (or the joint ledger's arena) sized here from every rank's memory
        and sent to the followers; decode graphs on every rank where the group can run them
        (``tp_graphs``), captured by all ranks at once; no lookahead.
        ``MLORA_TP_ONE_GPU=1`` (a debugging aid): every rank on ``cuda:0``, over gloo."""
        opts, device, dtype, size = self.opts, self.device, self.dtype, self.opts.tensor_parallel_size
        one_gpu = device.type == "cuda" and os.environ.get("MLORA_TP_ONE_GPU") == "1"
        if device.type == "cuda" and not one_gpu and torch.cuda.device_count() < size:
            raise JobError("E_TP_UNSUPPORTED", f"--tensor-parallel-size {size} puts one rank on each GPU, but "
                           f"{torch.cuda.device_count()} are visible: use at most that many", 2)
        try:
            config = load_config(opts.base)
            check_size(config, size)
        except ModelError as e:
            raise JobError(e.code, e.message, 2) from e
        backend = "nccl" if device.type == "cuda" and not one_gpu else "gloo"
        dtype_name = next(n for n, d in DTYPES.items() if d == dtype)
        devices = rank_devices(device.type, size, one_gpu)
        threads = torch.get_num_threads() if device.type == "cpu" else None  # each follower as many as rank 0
        self.tp = Leader(LeadGroup(follow, size, (opts.base, devices, dtype_name, threads), backend))
        graphs = decode_graphs(opts, device) and tp_graphs(backend, device.type)
        try:
            self.device = device = torch.device(devices[0])
            if device.type == "cuda":
                torch.cuda.set_device(device)
            self.model = DecoderModel.from_pretrained(opts.base, device=device, dtype=dtype, tp=TPLayout(0, size),
                                                      collective=self.tp.collective)
            usable = rank_usable(self.tp.memory(device), opts.gpu_memory_utilization)
            max_rank = max(max((p.max_rank for p in good.values()), default=0), 1)
            usable = self._leader_bank(good, bundle, TPShard(config, TPLayout(0, size), self.tp.collective), usable,
                                       graphs)
            self._tp_graphs = graphs
            if self.arena is not None:  # the joint ledger: its pages are the KV blocks
                num_blocks = self.arena.num_pages
            else:
                num_blocks = kv_blocks(opts, self.model.config, dtype, device, usable)
            self.tp.setup(Setup(num_blocks, opts.block_size, self.bank.num_slots if self.bank else 0, max_rank,
                                good, bundle=next(iter(good.values())) if bundle is not None else None,
                                bundle_operator=getattr(self.bank, "operator", "torch"),
                                graph_seqs=opts.max_num_seqs if graphs else 0,
                                host_cache_bytes=self._follower_cache_bytes(), arena=self._arena_shape(),
                                pinned_bytes=self._pinned_bytes()))
            if bundle is None and self.bank is not None and opts.preload_adapters:
                self._preload(good)
            self.metrics = JobMetrics()
            self.engine = self._engine(num_blocks)
            if graphs:  # every bucket now, on every rank in the same order (a capture holds all-reduces)
                self.tp.capture(self.engine.graphs.capture_all)
        except BaseException as e:
            raise self.tp.abort(e) from e
        self.pauses = RunPauses()
        self.pauses.start()

    def _leader_bank(self, good: dict[str, PinnedAdapter], bundle, shard: TPShard, usable: float | None,
                     graphs: bool) -> float | None:
        """``self.bank`` of rank 0 of a tensor-parallel group: the bundle's bank (its cut of
        the bases) or a residency bank of the adapters' cuts whose every copy the followers
        mirror (Triton where decode graphs capture it), or None without servable adapters;
        returns the ``usable`` bytes left for KV."""
        self.bank = None
        if bundle is not None:
            self.bank = self._bundle_bank(bundle, good, shard, usable)
            self.bank.leader = self.tp
            bank_bytes = self.bank.nbytes()
        elif good:
            self.bank = self._residency_bank(good, shard, usable, graphs)
            bank_bytes = self.bank.num_slots * self.bank.slot_bytes
        else:
            return usable
        return usable if usable is None else usable - bank_bytes

    def _arena_shape(self) -> ArenaShape | None:
        """The joint ledger's arena and slot runs, for the followers to carve theirs alike."""
        if self.arena is None:
            return None
        a = self.arena
        return ArenaShape(a.num_pages, a.page_bytes, a.spare_pages, self.bank.num_slots,
                          self.bank.residency.storage.pages_per_slot)

    def _pinned_bytes(self) -> int | None:
        """The bytes of rank 0's pinned pool of host images (None: it has none)."""
        pool = self.bank.pinned_pool if isinstance(self.bank, ResidencyBank) else None
        return None if pool is None else pool.nbytes

    def _follower_cache_bytes(self) -> int | None:
        """Each follower's host cache of its adapter cuts: as large as rank 0's residency bank
        resolved its own (None: unbounded); none beside a bundle's bank."""
        return self.bank.residency.host.capacity_bytes if isinstance(self.bank, ResidencyBank) else 0

    def _bundle_bank(self, bundle, good: dict[str, PinnedAdapter], shard: TPShard | None = None,
                     usable: float | None = None) -> BundleBank:
        """The bundle's shared bases resident and as many core slots as the adapters' share
        of GPU memory holds beside them (one per member at most, ``--max-gpu-adapters``);
        with ``shard``, rank 0's bank of a tensor-parallel group (its cut of the bases), sized
        from each rank's ``usable`` bytes (``sizing.rank_usable``)."""
        opts, device, dtype = self.opts, self.device, self.dtype
        if opts.memory_ledger == "joint":
            raise JobError("E_MEMORY_LEDGER", "--memory-ledger joint carves adapter slots and KV blocks from one "
                           "arena, but this job's adapters are the members of one bundle, served by its three-stage "
                           "operator with resident shared bases; use --memory-ledger split, or --bundle-operator "
                           "materialized to serve the members through slots", 2)
        operator = "triton" if opts.bundle_operator == "three-stage-triton" else "torch"
        if operator == "triton" and device.type != "cuda":
            raise JobError("E_BUNDLE_OPERATOR", "--bundle-operator three-stage-triton runs Triton kernels on a "
                           "CUDA device; use three-stage (or auto) here", 2)
        members = len(bundle.member_ids())
        core_slots = members if opts.max_gpu_adapters is None else max(1, min(members, opts.max_gpu_adapters))
        if device.type == "cuda":  # the bases stay resident; cores get as many slots as the rest holds
            share = adapter_share_bytes(opts, device, usable)
            bases, per_slot = BundleBank.split_bytes(bundle, dtype, operator, shard)
            fit = int((share - bases) // per_slot) - 1  # one more row: the base model's zero core
            if fit < 1:
                raise JobError("E_BUNDLE_TOO_LARGE", f"the bundle's shared bases and one core slot need "
                               f"{(bases + 2 * per_slot) / 2**30:.2f} GiB "
                               "resident, more than the adapters' share of GPU memory; serve its members through "
                               "slots with --bundle-operator materialized, raise --gpu-memory-utilization, or "
                               "give the KV cache less with --kv-cache-gb")
            core_slots = min(core_slots, fit)
        if shard is not None:
            return LeaderBundleBank.for_rank(bundle, shard, dtype, device, pinned=good, core_slots=core_slots,
                                             operator=operator)
        return BundleBank(bundle, self.model.config.num_layers, self.model.group_shapes(), dtype, device, pinned=good,
                          core_slots=core_slots, operator=operator)

    def _residency_bank(self, good: dict[str, PinnedAdapter], shard: TPShard | None = None,
                        usable: float | None = None, graphs: bool | None = None) -> ResidencyBank:
        """Slots for the modules the job's adapters target, at their largest rank, as many as
        the sizing gives (with ``--memory-ledger joint`` carved from one arena beside the KV
        cache, ``self.arena``), with host-image prefetch threads. With ``shard``: rank 0's bank
        of a tensor-parallel group, slots of every group at the rank's cut (the followers'
        ``SlotBank.for_rank`` shapes: their decode graphs and row-parallel all-reduces pair up
        with rank 0's), sized from each rank's ``usable`` bytes (the joint ledger: its arena over
        rank 0's KV heads and cut, rebuilt alike on every follower), every copy mirrored
        (``Leader.mirror``)."""
        opts, device, dtype, model = self.opts, self.device, self.dtype, self.model
        layers = model.config.num_layers
        max_rank = max(max((p.max_rank for p in good.values()), default=0), 1)
        host_bytes = int(opts.host_cache_gb * 2**30) if opts.host_cache_gb is not None else None  # 0: no cache
        if shard is not None:
            shapes, slices = bank_shapes(shard.config, shard.layout)[0], None
        else:
            # slots only for the modules some adapter of the job targets (q/v-only jobs need no MLP
            # slots and no k slice: a load then copies no zeros for k)
            slices = held_slices({m.role for p in good.values() for m in p.modules})
            shapes = {g: s for g, s in model.group_shapes().items() if g in slices} or model.group_shapes()
            slices = slices or None  # none targeted (no servable adapter has none): every slice of every group
        slot_bytes = ResidencyBank.bytes_per_slot(layers, shapes, max_rank, dtype, slices)
        if opts.memory_ledger == "joint":  # KV blocks and slots from one arena (docs/sizing.md)
            self.arena, slots = joint_arena(opts, model.config, dtype, device, len(good), slot_bytes, len(shapes),
                                            usable, graphs)
        else:
            slots = num_slots(opts, len(good), slot_bytes, device, usable)
        workers = prefetch_workers() if opts.prefetch_adapters else 0
        graphs = decode_graphs(opts, device) if graphs is None else graphs
        kw = dict(backend="triton" if graphs else "auto", host_cache_bytes=host_bytes, prefetch_workers=workers,
                  expected_adapters=len(good), build_processes=opts.image_build_processes if workers else 0)
        if shard is not None:
            bank = ResidencyBank.for_rank(shard, max(slots, 1), max_rank, dtype, device, self.tp.mirror,
                                          hint=self.tp.hint, arena=self.arena, **kw)
        else:
            bank = ResidencyBank(layers, shapes, max(slots, 1), max_rank, dtype, device, slices=slices,
                                 arena=self.arena, **kw)
        if workers and sys.getswitchinterval() > SWITCH_INTERVAL_S:
            # the engine thread gives the GIL to the prefetch threads at every device sync and
            # must win it back quickly: at Python's default 5 ms interval each re-acquisition
            # behind a busy builder could cost 5 ms (restored by close())
            self._switch = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        return bank

    def _preload(self, good: dict[str, PinnedAdapter]) -> None:
        """Load the first ``num_slots`` adapters before the first row (and before the metrics
        clock); their host images are built on the prefetch threads meanwhile (``ensure``
        waits for each)."""
        first = sorted(good)[:self.bank.num_slots]
        self.bank.prefetch(first, good)
        self.bank.ensure(first, good)

    def _engine(self, num_blocks: int | None = None) -> Engine:
        """The engine over the model and bank: the job's choices with decode graphs as this
        device runs them (under tensor parallelism as the group runs them, and no lookahead),
        KV blocks from the sizing (or the arena's pages), the job's sampling and stop strings."""
        opts, config = self.opts, self.model.config
        if num_blocks is None:
            num_blocks = (self.arena.num_pages if self.arena is not None
                          else kv_blocks(opts, config, self.dtype, self.device))
        decoding = Decoding(SamplingParams(opts.temperature, opts.top_p, opts.top_k, opts.seed), tuple(opts.stop),
                            self.tokenizer.decode if self.tokenizer else None)
        if self.tp is not None:
            # no lookahead, so no chained decode: a chained iteration's token ids are rank 0's
            # argmax on its device, which the followers' replays would need before rank 0 reads them
            choices = dataclasses.replace(opts, cuda_graphs=self._tp_graphs, lookahead=False)
        else:
            choices = dataclasses.replace(opts, cuda_graphs=decode_graphs(opts, self.device))
        return Engine(self.model, self.bank, self.pinned, choices, num_blocks=num_blocks, decoding=decoding,
                      metrics=self.metrics, arena=self.arena, tp=self.tp)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def record(self, res: Result) -> dict:
        """The output record of a finished row (kept input columns not included)."""
        return result_record(res, self.pinned, self.tokenizer)

    def run(self, requests) -> list[Result]:
        """Queue ``requests`` (Request or already-refused Result) and run until all finished."""
        out: list[Result] = []
        for r in requests:
            err = r if isinstance(r, Result) else self.engine.add(r)
            if err is not None:
                out.append(err)
        return out + self.engine.drain()

    def stats(self) -> tuple[dict, dict]:
        """(engine stats with ``kv_blocks``, bank stats without per-load timings)."""
        engine = dict(self.engine.stats, kv_blocks=self.engine.num_blocks, **self.pauses.stats())
        if self.engine.lookahead:  # iterations that ran on inputs built during the one before
            engine["lookahead_iterations"] = self.engine.lookahead_used
        if self.engine.chain:  # of those, launched before the iteration ahead of them was sampled
            engine["chained_iterations"] = self.engine.chained
        if self.engine.graphs is not None:  # decode steps replayed from graphs, and the buckets captured
            engine["graph_replays"] = self.engine.graphs.replays
            engine["graph_buckets"] = len(self.engine.graphs.graphs)
            if self.tp is not None and self.tp.reports is not None:  # the followers' own, read at close
                engine["follower_graph_replays"] = [r["graph_replays"] for r in self.tp.reports]
        if self.tp is not None and self.tp.reports and "host_cache_hits" in self.tp.reports[0]:
            for key in ("host_cache_hits", "host_cache_misses", "hinted_builds", "hinted_build_failures"):
                engine[f"follower_{key}"] = [r[key] for r in self.tp.reports]
        bank = self.bank.report() if self.bank is not None else {}
        if self.arena is not None:  # the joint memory mode: one arena of pages for KV and slots
            bank.update(memory_ledger="joint", arena_pages=self.arena.num_pages,
                        pages_per_slot=self.bank.residency.storage.pages_per_slot,
                        kv_pages_peak=self.engine.allocator.peak)
        return engine, bank

    def close(self) -> None:
        """Stop the bank's threads and the tensor-parallel followers (their failure, if any, is raised)."""
        if self.bank is not None:
            self.bank.close()  # prefetch threads
        if self.tp is not None:
            self.tp.stop()
        self.pauses.close()  # (stats() after close keep the pauses while the session ran)
        if self._switch is not None:
            sys.setswitchinterval(self._switch)
            self._switch = None


# the GIL switch interval while prefetch threads run: the engine thread must win the lock back
# quickly at every device sync (in the residency benchmark 50 us is slower than this)
SWITCH_INTERVAL_S = 500e-6


def prefetch_workers() -> int:
    """Adapter host images built ahead at once (read, re-hash, lay out, pin): one per four
    cores, at most four (one on a two-core machine). With ``image_build_processes`` each
    prefetch thread hands its build to a worker process (``residency/build.py``) and only
    pins the result."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def served_bundle(opts: JobConfig, good: dict[str, PinnedAdapter]):
    """The verified bundle to serve with the three-stage operator, or None for slots.

    ``auto``: the three-stage operator when every servable adapter of the job is a
    member of one bundle, slots otherwise; ``three-stage``: the same condition, and a
    job that does not meet it fails (E_BUNDLE_OPERATOR, exit 2) instead of being
    served another way; ``materialized``: always slots (each member's factors
    ``U_c core_i``, ``V_c^T`` in a slot of its own); ``three-stage-triton``: as
    ``three-stage``, the operator run by the segmented Triton kernels (CUDA only:
    E_BUNDLE_OPERATOR, exit 2, on another device)."""
    mode = opts.bundle_operator
    if mode == "materialized" or not good:
        return None
    bundles = {(p.bundle, p.artifact_sha256) if p.bundle else None for p in good.values()}
    if len(bundles) != 1 or None in bundles:
        if mode in ("three-stage", "three-stage-triton"):
            raise JobError("E_BUNDLE_OPERATOR", f"--bundle-operator {mode} serves the members of one bundle, "
                           "but this job also names adapters that are not members of it (or members of several "
                           "bundles); use --bundle-operator materialized or auto", 2)
        return None
    return pinned_bundle(next(iter(good.values())))


def result_record(res: Result, pinned: dict[str, PinnedAdapter], tokenizer: Tokenizer | None) -> dict:
    """``id`` and :data:`~mlora.batch.job.output.RESULT_FIELDS` of one finished (or refused) row.
    Without a tokenizer (a base without tokenizer.json) ``completion`` is null: no text exists."""
    p = pinned.get(res.adapter) if res.adapter is not None else None
    text = res.text if res.text is not None else (tokenizer.decode(res.token_ids) if tokenizer else None)
    return {
        "id": res.id,
        "adapter": res.adapter,
        "adapter_sha256": p.semantic_sha256 if (p is not None and p.ok) else None,
        "completion": text if res.finish_reason != "error" else "",
        "completion_token_ids": list(res.token_ids),
        "finish_reason": res.finish_reason,
        "num_prompt_tokens": res.num_prompt_tokens,
        "num_completion_tokens": len(res.token_ids),
        "error_code": res.error_code,
        "error_message": res.error_message,
    }


def requests_of(batch, opts: JobConfig, tokenizer: Tokenizer | None, vocab_size: int,
                kept: dict | None = None) -> Iterator[Request | Result]:
    """Requests (or refused rows as error Results) of one :class:`~mlora.batch.job.input.InputBatch`, in order.
    With ``kept``, each row's kept input columns are stored there by row position."""
    kept_rows = batch.kept.to_pylist() if (kept is not None and batch.kept is not None
                                           and batch.kept.num_columns) else None
    for i, rid in enumerate(batch.ids):
        row = batch.first_row + i
        if kept_rows is not None:
            kept[row] = kept_rows[i]
        adapter = batch.adapters[i]
        adapter = None if adapter in BASE_IDS else adapter
        mnt = batch.max_new_tokens[i] if batch.max_new_tokens is not None else None
        mnt = opts.max_new_tokens if mnt is None else int(mnt)
        if batch.prompt_ids is not None:
            ids = batch.prompt_ids[i]
            if ids is None:
                yield Result(row, rid, adapter, [], "error", 0, "E_PROMPT_NULL", "the prompt_ids cell is null")
                continue
            if any((t < 0 or t >= vocab_size) for t in ids):
                yield Result(row, rid, adapter, [], "error", len(ids), "E_PROMPT_TOKEN_RANGE",
                             f"a prompt token id is outside [0, {vocab_size})")
                continue
        elif batch.messages is not None:
            messages = batch.messages[i]
            if messages is None:
                yield Result(row, rid, adapter, [], "error", 0, "E_PROMPT_NULL", "the messages cell is null")
                continue
            try:
                ids = tokenizer.encode_chat(messages)
            except ChatMessagesError as exc:
                yield Result(row, rid, adapter, [], "error", 0, exc.code, exc.message)
                continue
        else:
            text = batch.prompts[i]
            if text is None:
                yield Result(row, rid, adapter, [], "error", 0, "E_PROMPT_NULL", "the prompt cell is null")
                continue
            ids = tokenizer.encode(text)
        yield Request(row, rid, list(ids), adapter, mnt)
