"""The generation engine: continuous batching over a paged KV cache.

Owns the lifetime of requests inside the engine (spec 0x01C request state and
0x03 iteration state): admission (arrival order, bounded by ``max_num_seqs``,
the KV cache and the adapter slot bank; a row whose adapter cannot get a slot
is overtaken by at most ``max_wait`` later rows),
the mixed prefill/decode iteration plan of
spec 0x03A-0x03C (chunked prefill under a ``max_batch_tokens`` budget,
phase-major packing: prefill rows first, then decode rows, with
``prefill_indptr`` and ``doff``), preemption by recompute when the KV cache
runs out, sampling and stop rules. Rows leave the engine as ``Result``s in
completion order; the job runner puts them back in input order.

Per iteration::

    schedule  -> IterationPlan (sequences, rows per sequence, positions, rows to sample)
    blocks    -> every scheduled sequence holds KV blocks for its new tokens
    adapters  -> bank.ensure(distinct adapters) -> slot per row (-1 = base only)
    forward   -> logits of the sample rows
    sample    -> append tokens, finish rows (eos | stop string | max_new_tokens | context)

Invariants: a sequence is in exactly one of waiting / running / finished; the
adapters of the running sequences are never more than the bank's slots, so
``ensure`` never has to evict an adapter in use; a preempted sequence keeps its
generated tokens and recomputes its KV (same tokens, same random stream).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from mlora.batch.model.attention import AttentionMetadata
from mlora.batch.adapters.catalog import AdapterError
from mlora.batch.envknobs import env_choice
from mlora.batch.engine.graphs import DecodeGraphs
from mlora.batch.engine.joint import LedgerBlocks
from mlora.batch.model.kvcache import BlockAllocator, KVCache, KVCacheFull
from mlora.batch.engine.sampling import SamplingParams, row_key, sample
from mlora.batch.engine.waiting import WaitingQueue


CHAIN_ENV = "MLORA_CHAIN_DECODE"


def chain_from_env() -> bool:
    """``MLORA_CHAIN_DECODE`` (``1``, the default since the twenty-sixth session, or ``0``;
    anything else refused, named)."""
    return env_choice(CHAIN_ENV, ("0", "1"), "1") == "1"


@dataclass
class Request:
    row: int  # global input row position
    id: str
    prompt_ids: list[int]
    adapter: str | None  # None = base model on purpose
    max_new_tokens: int


@dataclass
class Result:
    row: int
    id: str
    adapter: str | None
    token_ids: list[int]
    finish_reason: str  # stop | length | error
    num_prompt_tokens: int
    error_code: str | None = None
    error_message: str | None = None
    text: str | None = None  # the completion, cut before a stop string (None: decode token_ids)


@dataclass(eq=False)  # identity: the scheduler looks sequences up in its lists on every iteration
class Sequence:
    req: Request
    key: int
    tokens: list[int]
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    admitted: int = 0  # admission counter (preemption picks the latest)
    arrival: int = 0  # admissions before the request arrived (kept across preemption)
    lease: str | None = None  # the bank lease on its adapter while running (spec 0x07H)
    is_running: bool = False  # in Engine.running (kept in step with it: O(1) membership)
    text: str | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.req.prompt_ids):]

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.req.prompt_ids)

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.num_computed


@dataclass
class IterationPlan:
    """One model invocation (spec 0x03A): packed rows, phase-major."""

    seqs: list[Sequence]
    new_tokens: list[int]  # rows of each sequence in this iteration
    sample: list[bool]  # does this sequence's last row get sampled
    prefill_indptr: list[int]  # row offsets of the prefill sequences (spec 0x03A)
    doff: int  # first decode row

    @property
    def num_rows(self) -> int:
        return sum(self.new_tokens)

    @classmethod
    def decode_only(cls, seqs: list[Sequence]) -> "IterationPlan":
        """One new row per sequence, every row sampled, no prefill (a looked-ahead iteration)."""
        n = len(seqs)
        return cls(seqs=list(seqs), new_tokens=[1] * n, sample=[True] * n, prefill_indptr=[0], doff=0)


@dataclass
class Lookahead:
    """The inputs of the next iteration, built while the device still runs the current
    one, on the guess that it will be "the same decode rows, one more token each"
    (``Engine(lookahead=True)``). ``p0``: each row's position in that iteration (its
    ``num_computed`` then); token ids are read from the rows once they are sampled.
    ``staged``: the decode graphs' input buffers already hold positions, cache slots,
    context lengths and block tables (copies queued behind the current iteration)."""

    seqs: list[Sequence]
    p0: list[int]
    positions: list[int]
    slots_map: list[int]
    ctx: list[int]
    tables: list[list[int]]
    row_adapters: list[str | None]
    staged: bool = False


class Engine:
    def __init__(
        self,
        model,
        bank,
        pinned: dict,
        *,
        num_blocks: int,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_batch_tokens: int = 2048,
        sampling: SamplingParams = SamplingParams(),
        stop_strings: tuple[str, ...] = (),
        detokenize: Callable[[list[int]], str] | None = None,
        device="cpu",
        dtype=torch.float32,
        max_wait: int = 256,
        metrics=None,
        cuda_graphs: bool = False,
        prefetch_depth: int = 16,
        prefetch_gpu: int = 4,
        async_loads: bool | None = None,
        lookahead: bool = False,
        arena=None,
        chain: bool | None = None,
    ):
        """``arena`` (an ``arena.PageArena`` whose pages ``bank``, a ResidencyBank, was carved
        from): the joint memory mode, KV blocks from the bank's ledger (``joint.LedgerBlocks``;
        ``num_blocks`` must be the arena's ledger pages) and cold adapters always loaded
        asynchronously (a load reserves its slot's pages when the row is admitted).

        ``chain`` (None: ``MLORA_CHAIN_DECODE``, default ``1``; see :meth:`_chain`): with
        lookahead, decode graphs and greedy sampling (and not in the joint memory mode), launch
        the looked-ahead decode iteration from the device's argmax before reading this
        iteration's tokens."""
        cfg = model.config
        if stop_strings and detokenize is None:
            raise ValueError("stop strings need a detokenizer")
        self.model, self.bank, self.pinned = model, bank, pinned
        self.block_size, self.max_num_seqs, self.max_batch_tokens = block_size, max_num_seqs, max_batch_tokens
        self.sampling, self.stop_strings, self.detokenize = sampling, tuple(stop_strings), detokenize
        self.device = torch.device(device)
        self.eos = set(cfg.eos_token_ids)
        self.max_context = cfg.max_position_embeddings
        # with CUDA graphs one extra block, owned by no sequence, takes the padded rows' K/V
        self.joint = arena is not None
        self.max_row_blocks = num_blocks  # KV blocks one row may ever hold
        if self.joint:
            if getattr(bank, "arena", None) is not arena or arena.num_pages != num_blocks \
                    or arena.spare_pages != int(cuda_graphs):
                raise ValueError("the joint memory mode needs a bank carved from this arena, num_blocks = its "
                                 "ledger pages and one spare page with CUDA graphs")
            pages = arena.kv_pages(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
            self.kv = KVCache(cfg.num_layers, num_blocks + int(cuda_graphs), block_size, cfg.num_kv_heads,
                              cfg.head_dim, dtype, self.device, pages=pages)
            self.allocator = LedgerBlocks(bank.residency)
            self.max_row_blocks = num_blocks - bank.residency.storage.pages_per_slot  # beside one adapter
        else:
            self.kv = KVCache(cfg.num_layers, num_blocks + int(cuda_graphs), block_size, cfg.num_kv_heads,
                              cfg.head_dim, dtype, self.device)
            self.allocator = BlockAllocator(num_blocks)
        self.graphs = None
        if cuda_graphs:
            self.graphs = DecodeGraphs(model, self.kv, bank, max_num_seqs, scratch_slot=num_blocks * block_size)
        self.num_blocks = num_blocks
        self.num_slots = getattr(bank, "num_slots", 0) if bank is not None else 0
        self.max_wait = max_wait  # later rows that may be admitted before a waiting row blocks admission
        # cold adapters of the waiting rows whose host images are built ahead, in the background
        self.prefetch_depth = prefetch_depth if hasattr(bank, "prefetch") else 0
        # ... and of those, how many may start loading into free or unneeded GPU slots per iteration
        self.prefetch_gpu = prefetch_gpu if hasattr(bank, "prefetch_device") and self.prefetch_depth else 0
        # admission starts an admitted cold adapter's load and runs its rows once it is published
        # (spec 0x09B), so the copy overlaps the iteration in flight instead of blocking the next
        # one. Default: on a GPU (on the CPU copies are synchronous: deferring rows gains nothing)
        if async_loads is None:
            async_loads = self.device.type == "cuda"
        if self.joint:  # a load must hold its slot's pages from admission on (KV could take them)
            async_loads = True
        self.async_loads = async_loads and bool(self.prefetch_gpu) and hasattr(bank, "start_load")
        pf = getattr(bank, "prefetcher", None)  # prefetches before this engine (e.g. a preload) are not its own
        self._prefetch_seen = (pf.issued, pf.used) if pf is not None else (0, 0)
        # build the next decode iteration's inputs while the device runs this one, and use them
        # when the next schedule would be exactly that iteration (``Lookahead``); the device
        # then does not wait for the host's input building between decode iterations
        self.lookahead = lookahead
        self._next: Lookahead | None = None
        self.lookahead_used = 0
        if chain is None:
            chain = chain_from_env()
        # not in the joint memory mode: a row that finishes while the chained iteration runs
        # frees KV pages the ledger may hand to an adapter load on another stream at once
        self.chain = bool(chain) and lookahead and cuda_graphs and not self.joint
        self._inflight: tuple[IterationPlan, torch.Tensor] | None = None  # launched, not yet sampled
        self.chained = 0
        self.metrics = metrics  # mlora.batch.job.metrics.JobMetrics or None
        # called once per iteration after its host work, right before sampling waits for the
        # device (the session's MLORA_GC=device-wait collector: host time the device hides)
        self.device_wait_hook = None
        self._seen_adapters: set[str] = set()
        self.waiting = WaitingQueue()  # rows in queue order, with the number per adapter
        self.running: list[Sequence] = []
        self._admissions = 0
        self.stats = dict(iterations=0, prefill_tokens=0, decode_tokens=0, generated_tokens=0, preemptions=0)

    # ---- requests ------------------------------------------------------------------

    def add(self, req: Request) -> Result | None:
        """Queue a request; a request that can never run is returned at once as an error Result."""
        err = self._reject(req)
        if err:
            return Result(req.row, req.id, req.adapter, [], "error", len(req.prompt_ids), *err)
        self.waiting.append(Sequence(req, row_key(self.sampling.seed, req.id), list(req.prompt_ids),
                                     arrival=self._admissions))
        return None

    def _reject(self, req: Request) -> tuple[str, str] | None:
        n = len(req.prompt_ids)
        if n == 0:
            return "E_PROMPT_EMPTY", "the prompt has no tokens; give a non-empty prompt"
        if n >= self.max_context:
            return ("E_PROMPT_TOO_LONG", f"the prompt has {n} tokens; the model's context is {self.max_context} "
                    "(shorten the prompt)")
        need = -(-min(n + max(req.max_new_tokens, 1), self.max_context) // self.block_size)
        if need > self.max_row_blocks:
            return ("E_PROMPT_TOO_LONG", f"prompt + max_new_tokens need {need} KV blocks, the cache holds "
                    f"{self.max_row_blocks} (shorten the prompt, lower --max-new-tokens or give the cache more memory)")
        if req.adapter is not None:
            p = self.pinned.get(req.adapter)
            if p is None or not p.ok:
                code = getattr(p, "error_code", None) or "E_ADAPTER_UNKNOWN"
                msg = getattr(p, "error_message", None) or f"adapter {req.adapter!r} is not in the catalog"
                return code, msg
        if req.max_new_tokens < 1:
            return "E_MAX_NEW_TOKENS", f"max_new_tokens is {req.max_new_tokens}; it must be >= 1"
        return None

    @property
    def adapters_used(self) -> frozenset[str]:
        """Adapters some row of this engine has run with (the job counts each one's bytes once)."""
        return frozenset(self._seen_adapters)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_queued(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one iteration ---------------------------------------------------------------

    def step(self) -> list[Result]:
        """Run one iteration; return the rows that finished in it."""
        if self.prefetch_gpu:  # GPU-tier prefetch (and async_loads, which needs it) starts loads ahead
            self.bank.end_invocation()
            self._commit_loads()  # loads started during the last iteration: published now, so
            # every slot this schedule counts on is published or free (an uncommitted load would
            # hold a slot admission does not see: E_ADMISSION_CAPACITY in ensure)
        inflight, self._inflight = self._inflight, None
        if inflight is not None and not any(s.is_running for s in inflight[0].seqs):
            inflight = None  # every row of the chained iteration finished before it: nothing to read
        if inflight is not None:  # launched by the last step (_chain): its rows, one token each
            plan, logits = inflight
            t0 = time.perf_counter()
        else:
            ahead, self._next = self._next, None
            plan = self._take(ahead) if ahead is not None else None
            if plan is None:
                ahead = None
                plan = self.schedule()
            if plan is None and self.async_loads and self.bank.loads_in_flight():
                self._commit_loads()  # every waiting row waits for a load: wait for them here
                plan = self.schedule()
            if plan is None:
                return []
            t0 = time.perf_counter()
            try:
                logits = self._forward(plan, ahead)
            except AdapterError as exc:  # e.g. its bytes changed since the job started: never served
                if self.metrics:
                    self.metrics.adapter_load(0, time.perf_counter() - t0, ok=False, tier_from="disk")
                return self._fail_adapter(exc.adapter_id, exc.code, str(exc).split(": ", 1)[-1])
        # host work for later iterations, done while the device runs this one (the sampled
        # tokens are read in _advance): eviction ranking and prefetch of coming adapters
        if hasattr(self.bank, "want"):  # eviction keeps adapters that waiting rows still need
            self.bank.want(self.waiting.adapters(), self.pinned)
        if self.prefetch_depth:
            self._prefetch()
        record = self._iteration_record(plan) if self.metrics else None  # before _advance waits for the device
        done = self._advance(plan, logits)
        if record is not None:
            self.metrics.iteration(*record, time.perf_counter() - t0)
        return done

    def _prefetch(self) -> None:
        """Ask the bank to build the host images of the next ``prefetch_depth`` cold
        adapters among the waiting rows, in the order admission will bring them in
        (``_slot_plan``: small, big, then the rest), while this iteration's rows run, and
        to start loading up to ``prefetch_gpu`` of the next admission's (small, big) into
        free or unneeded slots (``ResidencyBank.prefetch_device``)."""
        active = {s.req.adapter for s in self.running if s.req.adapter is not None}
        resident = set(self.bank.resident)
        _, small, big, rest = self._slot_plan(active)
        cold: list[str] = []
        for a in small + big + rest:
            p = self.pinned.get(a)
            if p is None or not p.ok or p.semantic_sha256 in resident:
                continue
            cold.append(a)
            if len(cold) >= self.prefetch_depth:
                break
        if cold:
            self.bank.prefetch(cold, self.pinned)
            if self.prefetch_gpu:
                # images already built start copying to the GPU now, on the side stream; only for
                # the adapters the next admission gives slots to (a prefetched adapter that waits
                # longer would hold a slot the next admissions need, and be evicted unused)
                planned = set(small + big)
                self.bank.prefetch_device([a for a in cold if a in planned], self.pinned, self.prefetch_gpu)
        pf = self.bank.prefetcher
        if self.metrics and pf is not None:
            issued, used = self._prefetch_seen
            self.metrics.prefetch(pf.issued - issued, pf.used - used)
            self._prefetch_seen = (pf.issued, pf.used)

    def _iteration_record(self, plan: IterationPlan) -> tuple[int, int, int, int, int]:
        """The iteration metrics' figures but its time: (prefill rows, decode rows, distinct
        adapters, true rank rows, padded rank rows); rank rows use each adapter's largest
        module rank (true) against the bank's physical rank (padded)."""
        true = padded = 0
        distinct = set()
        for seq, n in zip(plan.seqs, plan.new_tokens):
            a = seq.req.adapter
            if a is None:
                continue
            distinct.add(a)
            true += n * self.pinned[a].max_rank
            padded += n * getattr(self.bank, "max_rank", 0)
        return plan.doff, plan.num_rows - plan.doff, len(distinct), true, padded

    def _fail_adapter(self, adapter_id: str | None, code: str, message: str) -> list[Result]:
        """Retire an adapter that can no longer be served: every queued row that
        names it becomes an error row; the other rows continue."""
        if adapter_id is None:
            raise RuntimeError(f"{code}: {message}")
        p = self.pinned.get(adapter_id)
        if p is not None:
            self.pinned[adapter_id] = dataclasses.replace(p, ok=False, error_code=code, error_message=message, modules=())
        out = []
        for seq in [s for s in self.running if s.req.adapter == adapter_id]:
            self._drop(seq)
            out.append(self._error(seq, code, message))
        for seq in self.waiting.take_if(lambda s: s.req.adapter == adapter_id):
            out.append(self._error(seq, code, message))
        return out

    @staticmethod
    def _error(seq: Sequence, code: str, message: str) -> Result:
        r = seq.req
        return Result(r.row, r.id, r.adapter, [], "error", len(r.prompt_ids), code, message)

    def schedule(self) -> IterationPlan | None:
        budget = self.max_batch_tokens
        chosen: list[tuple[Sequence, int]] = []
        # decodes first (one row each), then prefill chunks of running sequences (a stable
        # partition; a sequence's pending count does not change in this loop unless it is preempted)
        pending = [(s, len(s.tokens) - s.num_computed) for s in self.running]
        for seq, p in [x for x in pending if x[1] == 1] + [x for x in pending if x[1] != 1]:
            if budget <= 0:
                break
            if not seq.is_running:  # preempted by an earlier reservation in this loop
                continue
            n = min(p, budget)
            if not self._reserve(seq, n):
                break  # cache full even after preemption: the rest waits for the next iteration
            chosen.append((seq, n))
            budget -= n
        chosen = [(s, n) for s, n in chosen if s.is_running]  # drop preempted ones
        # admit waiting sequences while seats, KV and budget allow (spec 0x09B: a cold
        # adapter is load-eligible, not executable). Rows whose adapter needs no load
        # (base, running or resident in the bank) go first, each class in arrival
        # order; a row whose adapter cannot get a slot now is skipped. Once any waiting
        # row has seen max_wait later rows admitted, strict arrival order applies and
        # nobody may overtake an aged row that does not fit (0x09I: no starvation).
        if self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            budget = self._admit(chosen, budget)
        if not chosen:
            return None
        prefill, decode = [], []
        for s, n in chosen:
            (decode if s.num_computed > 0 and len(s.tokens) - s.num_computed == 1 else prefill).append((s, n))
        ordered = prefill + decode  # phase-major packing (spec 0x03A)
        indptr = [0]
        for _, n in prefill:
            indptr.append(indptr[-1] + n)
        return IterationPlan(
            seqs=[s for s, _ in ordered],
            new_tokens=[n for _, n in ordered],
            sample=[s.num_computed + n == len(s.tokens) for s, n in ordered],
            prefill_indptr=indptr,
            doff=indptr[-1],
        )

    def _admit(self, chosen: list, budget: int) -> int:
        """Admit waiting sequences into ``chosen``; returns the budget left."""
        if budget <= 0 or len(self.running) >= self.max_num_seqs or not self.waiting:
            return budget  # nothing can be admitted: skip the ordering work (the steady decode state)
        now = self._admissions  # a row's wait is the number of rows admitted since it arrived
        active = {s.req.adapter for s in self.running if s.req.adapter is not None}
        # slots that must stay as they are this pass: running rows' adapters, adapters admitted
        # or whose load started in this pass. ``active`` adds the adapters published for waiting
        # rows, which no row holds yet (idle: a load may evict them)
        busy = set(active)
        if self.async_loads:  # adapters loaded for waiting rows (asynchronous loads) hold their slots: run them
            active |= self._resident_waiting_adapters()
        aged = now - self.waiting.min_arrival() >= self.max_wait
        if aged:
            candidates = self.waiting  # strict queue order; the pass stops at the first aged row that waits
        else:
            # only rows this pass can admit: base rows, rows of active adapters and of the new
            # adapters the free slots go to (_slot_plan's small and big; the rest cannot get a
            # slot in this pass), then sorted. A pass admits at most ``seats`` rows, and once it
            # skips a row of an adapter it skips the rest of that adapter's rows: the first
            # ``seats`` rows of each are all it can use, whatever the scheduling window holds
            order, admissible = self._slot_order(active)
            seats = self.max_num_seqs - len(self.running)
            candidates = self.waiting.rows_of(None, seats)
            for a in admissible:
                candidates += self.waiting.rows_of(a, seats)
            position = self.waiting.position
            candidates.sort(key=lambda s: (order(s), position(s)))
        admitted = []
        loading: set[str] = set()  # adapters whose load this pass started (or found in flight): rows wait
        for seq in candidates:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            a = seq.req.adapter
            held = aged and now - seq.arrival >= self.max_wait  # an aged row that waits: nobody overtakes it
            if a in loading:
                if held:
                    break
                continue
            if a is not None and a not in busy:
                if a in active:  # published for waiting rows: its slot is there if the pass has room
                    full = len(busy) >= self.num_slots
                else:  # cold: needs a free slot. An aged row may also take the slot of an idle
                    # adapter that only waiting rows name (otherwise, with every slot idle that way,
                    # it would wait for rows it does not let pass: the deadlock of a 1,000-adapter /
                    # 8,000-row job on the H200)
                    full = len(active) >= self.num_slots and not (held and len(busy) < self.num_slots)
                if full:
                    if held:
                        break
                    continue
            # joint memory mode: cold is "not published now" (KV admitted earlier in this pass may
            # have evicted an idle adapter counted active), and every cold load starts here, so
            # that it holds its slot's pages before later rows' KV can take them
            cold = a is not None and (not self._published(a) if self.joint else a not in active)
            if cold and self.async_loads and (chosen or self.running or self.joint):
                # a cold adapter: start its load now (the copy overlaps this iteration) and
                # run its rows once it is published; with nothing else to run, load it the
                # blocking way instead (in ensure), so every iteration makes progress
                status = self.bank.start_load(a, self.pinned)
                if status in ("started", "loading", "building") or (self.joint and status == "no-room"):
                    if status in ("started", "loading"):
                        active.add(a)  # its slot is taken
                        busy.add(a)
                        loading.add(a)
                    if held:
                        break
                    continue  # joint, no room: no slot's pages are free now (KV holds them); wait
                if self.joint and status == "sync" and not self._load_now(a):
                    # the rare paths that say "sync" (a build or an earlier asynchronous attempt failed):
                    # loaded here, the blocking way, so that it holds its slot's pages before this pass's
                    # KV; no slot's pages to be had now: the row waits
                    if held:
                        break
                    continue
            n = min(seq.pending, budget)
            blocks = self._blocks_needed(seq, n)
            lease = None
            if self.joint and a is not None and seq.lease is None and self._published(a):
                # bound first: this row's KV (and later rows') must not evict it as an idle adapter
                lease = f"row{seq.req.row}"
                self.bank.residency.acquire(lease, self.pinned[a].semantic_sha256)  # published: no load, no count
            if not self.allocator.has(blocks):
                if lease is not None:
                    self.bank.release(lease)
                break
            self._admissions += 1
            seq.admitted = self._admissions
            self.running.append(seq)
            seq.is_running = True
            seq.lease = seq.lease or lease
            seq.blocks += self.allocator.allocate(blocks, seq)
            chosen.append((seq, n))
            budget -= n
            admitted.append(seq)
            if a is not None:
                active.add(a)
                busy.add(a)
        self.waiting.discard(admitted)
        return budget

    def _load_now(self, adapter: str) -> bool:
        """Joint memory mode: load ``adapter`` now, the blocking way; False when no slot's pages
        can be had now. A load that fails for the adapter's own reasons says True: the row is
        admitted and the forward's load raises the error where the engine fails its rows."""
        tier = self.bank.source_tier(adapter, self.pinned)  # host cache or disk, before the load
        evictions, t0 = self.bank.stats.evictions, time.perf_counter()
        try:
            if not self.bank.load_now(adapter, self.pinned):
                return False
        except AdapterError:
            return True
        if self.metrics:  # as a load started ahead (_commit_loads): the forward's ensure counts the device hit
            self.metrics.cache(tier == "host", "host")
            self.metrics.adapter_load(stored_adapter_bytes(self.pinned[adapter]), time.perf_counter() - t0, True, tier)
            self._count_evictions(evictions)
        return True

    def _published(self, adapter: str) -> bool:
        """Whether the bank has a published generation of ``adapter`` now (joint memory mode)."""
        return self.pinned[adapter].semantic_sha256 in self.bank.residency.catalog

    def _resident_waiting_adapters(self) -> set[str]:
        """Adapters that some waiting row names and whose generation is published in the
        bank (in time proportional to the distinct waiting adapters, not to the queue)."""
        resident = self.bank.resident
        return {a for a in self.waiting.counts if getattr(self.pinned.get(a), "semantic_sha256", None) in resident}

    def _slot_plan(self, active: set) -> tuple[Counter, list[str], list[str], list[str]]:
        """(waiting rows per adapter, small, big, rest): how one admission pass gives out
        the free adapter slots.

        The free slots are split between the new adapters with the most waiting rows,
        as many as it takes to fill the free row capacity (``big``, most rows first),
        and, for the slots left, the adapters with the fewest (``small``, fewest
        first); ``rest`` are the other new adapters, fewest rows first. An adapter
        with one or two rows holds a slot as long as one with fifty does, so rare
        adapters run alongside the popular ones from the start instead of being left
        for a tail in which every slot holds a row or two (before: 1.5x the
        iterations of an all-resident run with 64 slots; BENCHMARKS.md, residency)."""
        waiting_rows = self.waiting.counts  # waiting rows per adapter (kept by the queue, not counted here)
        new = sorted((a for a in waiting_rows if a not in active), key=waiting_rows.__getitem__)
        free_slots = max(self.num_slots - len(active), 0)
        free_rows = self.max_num_seqs - len(self.running)
        free_rows -= sum(waiting_rows.get(a, 0) for a in active)
        free_rows -= self.waiting.base_rows
        big, covered = [], 0
        for a in reversed(new):
            if covered >= free_rows or len(big) >= free_slots:
                break
            big.append(a)
            covered += waiting_rows[a]
        chosen = set(big)
        small = [a for a in new if a not in chosen][: free_slots - len(big)]
        chosen.update(small)
        return waiting_rows, small, big, [a for a in new if a not in chosen]

    def _slot_order(self, active: set) -> tuple[Callable, set[str]]:
        """(sort key, admissible adapters) of one admission pass. The key orders the rows of
        admissible adapters (with queue position as tie-break): the small adapters' rows, rows
        that need no slot (active adapters, base), then the big adapters' rows
        (``_slot_plan``); the set holds ``active`` plus small and big (the other adapters get
        no slot in this pass, and their rows are not candidates)."""
        waiting_rows, small, big, _ = self._slot_plan(active)
        key_of = {a: (0, waiting_rows[a]) for a in small}
        key_of.update((a, (2, -waiting_rows[a])) for a in big)
        # base rows and active adapters: (1, 0); second: the adapters a row may be admitted with
        return (lambda seq: key_of.get(seq.req.adapter, (1, 0))), active.union(small, big)

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        return max(0, -(-(seq.num_computed + n) // self.block_size) - len(seq.blocks))

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Blocks for ``n`` more tokens of a running sequence, preempting the latest
        admitted other sequences (recompute) when the cache is full."""
        need = self._blocks_needed(seq, n)
        if need == 0:  # most decode steps: the last block has room
            return True
        while not self.allocator.has(need):
            victims = [s for s in self.running if s is not seq]
            if not victims:
                return False
            self._preempt(max(victims, key=lambda s: s.admitted))
        if need:
            try:
                seq.blocks += self.allocator.allocate(need, seq)
            except KVCacheFull:
                return False
        return True

    def _drop(self, seq: Sequence) -> None:
        """Take a sequence out of the running set: its adapter lease and KV blocks go back."""
        if seq.lease is not None:
            self.bank.release(seq.lease)
            seq.lease = None
        self.running.remove(seq)
        seq.is_running = False
        self.allocator.free(seq.blocks, seq)
        seq.blocks = []

    def _preempt(self, seq: Sequence) -> None:
        if self.metrics:
            self.metrics.preemption()
        self._drop(seq)
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.stats["preemptions"] += 1

    def _forward(self, plan: IterationPlan, ahead: Lookahead | None = None) -> torch.Tensor:
        if ahead is not None:  # inputs built during the previous iteration (_look_ahead); ids known now
            ids = [s.tokens[p] for s, p in zip(ahead.seqs, ahead.p0)]
            pos, slots_map, ctx, tables, row_adapters = (ahead.positions, ahead.slots_map, ahead.ctx, ahead.tables,
                                                         ahead.row_adapters)
            starts, sample_rows = list(range(len(ids) + 1)), list(range(len(ids)))
            return self._launch(plan, ids, pos, slots_map, starts, ctx, tables, sample_rows, row_adapters,
                                staged=ahead.staged)
        ids, pos, slots_map, starts, ctx, tables, sample_rows, row_adapters = [], [], [], [0], [], [], [], []
        bs, end = self.block_size, 0
        for seq, n in zip(plan.seqs, plan.new_tokens):
            p0, blocks = seq.num_computed, seq.blocks
            if n == 1:  # a decode row (the steady state: one append per list, no slicing)
                ids.append(seq.tokens[p0])
                pos.append(p0)
                slots_map.append(blocks[p0 // bs] * bs + p0 % bs)
                row_adapters.append(seq.req.adapter)
            else:
                ids += seq.tokens[p0 : p0 + n]
                pos += range(p0, p0 + n)
                slots_map += [blocks[p // bs] * bs + p % bs for p in range(p0, p0 + n)]
                row_adapters += [seq.req.adapter] * n
            end += n
            starts.append(end)
            ctx.append(p0 + n)
            tables.append(blocks)  # read within this invocation only
        for b, s in enumerate(plan.sample):
            if s:
                sample_rows.append(starts[b + 1] - 1)
        return self._launch(plan, ids, pos, slots_map, starts, ctx, tables, sample_rows, row_adapters)

    def _count(self, plan: IterationPlan) -> None:
        """The job's iteration and token counters, for an iteration launched now."""
        self.stats["iterations"] += 1
        self.stats["prefill_tokens"] += plan.doff
        self.stats["decode_tokens"] += plan.num_rows - plan.doff

    def _launch(self, plan: IterationPlan, ids, pos, slots_map, starts, ctx, tables, sample_rows, row_adapters,
                staged: bool = False) -> torch.Tensor:
        """Resolve the invocation's adapters to slots (loads, leases) and run the model on the
        packed inputs (a decode graph when the iteration is decode-only and fits one)."""
        dev = self.device
        slot_list = None
        distinct = sorted({a for a in row_adapters if a is not None})
        if distinct:
            slot_of = self._ensure(distinct)
            if hasattr(self.bank, "acquire"):  # a running row's adapter stays resident between iterations
                for seq in plan.seqs:
                    if seq.req.adapter is not None and seq.lease is None:
                        self.bank.acquire(f"row{seq.req.row}", seq.req.adapter, self.pinned)
                        seq.lease = f"row{seq.req.row}"
            slot_list = [slot_of[a] if a is not None else -1 for a in row_adapters]
        self._count(plan)
        # decode-only (one row per sequence, every row sampled): replay a captured graph
        if self.graphs is not None and plan.doff == 0 and len(sample_rows) == len(ids) \
                and self.graphs.fits(len(ids), max(len(t) for t in tables)):
            return self.graphs.run(ids, pos, slots_map, tables, ctx, slot_list, staged=staged)
        lora = self.bank.context(torch.tensor(slot_list, dtype=torch.int32)) if slot_list is not None else None
        meta = AttentionMetadata(
            query_starts=starts, context_lens=ctx, block_tables=tables,
            slot_mapping=torch.tensor(slots_map, dtype=torch.int64, device=dev),
        )
        return self.model.forward(
            torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(pos, dtype=torch.int64, device=dev),
            meta, self.kv, lora, torch.tensor(sample_rows, dtype=torch.int64, device=dev),
        )

    def _ensure(self, adapters: list[str]) -> dict[str, int]:
        """bank.ensure, with load, cache and eviction metrics (loads started ahead are
        committed at the start of the step: ``_commit_loads``)."""
        if not self.metrics:
            return self.bank.ensure(adapters, self.pinned)
        before = dict(self.bank.resident)
        # where a load will copy from: the host cache (e.g. prefetched) or disk
        tier_of = getattr(self.bank, "source_tier", lambda a, pinned: "disk")
        tiers = {a: tier_of(a, self.pinned) for a in adapters if self.pinned[a].semantic_sha256 not in before}
        evictions = self.bank.stats.evictions
        t0 = time.perf_counter()
        slot_of = self.bank.ensure(adapters, self.pinned)
        seconds = time.perf_counter() - t0
        loaded = [a for a in adapters if self.pinned[a].semantic_sha256 not in before]
        for a in adapters:
            hit = a not in loaded
            self.metrics.cache(hit, "device")
            if a not in self._seen_adapters:
                self._seen_adapters.add(a)
                self.metrics.unique_adapter_bytes(stored_adapter_bytes(self.pinned[a]))
        for a in dict.fromkeys(loaded):
            self.metrics.cache(tiers[a] == "host", "host")
            self.metrics.adapter_load(stored_adapter_bytes(self.pinned[a]), seconds / max(len(loaded), 1), True, tiers[a])
        self._count_evictions(evictions)
        return slot_of

    def _count_evictions(self, before: int) -> None:
        """Device evictions since the bank's eviction count was ``before``, into the metrics."""
        for _ in range(self.bank.stats.evictions - before):
            self.metrics.eviction("device")

    def _commit_loads(self) -> None:
        """Publish the loads started ahead (admission's asynchronous loads, GPU-tier
        prefetch): counted as loads from the host tier, with the time the engine waited
        for them (the part that did not overlap device work) as their latency."""
        evictions = self.bank.stats.evictions
        done = self.bank.commit_device()
        if self.metrics:
            for a, seconds in done:
                self.metrics.cache(True, "host")
                self.metrics.adapter_load(stored_adapter_bytes(self.pinned[a]), seconds, True, "host")
            self._count_evictions(evictions)

    def _look_ahead(self, plan: IterationPlan) -> Lookahead | None:
        """The next iteration's inputs if it is "every row of this decode-only iteration, one
        more token each" (None when this iteration is not decode-only, other rows run or
        could be admitted, or a row would need a block the cache does not have free). Rows
        that will need a new KV block get it now: the schedule would give it to them anyway,
        and a row that finishes instead frees it with its others."""
        n = len(plan.seqs)
        if plan.doff != 0 or n > self.max_batch_tokens or not all(plan.sample) or not self._only_running(n):
            return None
        bs = self.block_size
        p0 = [s.num_computed + 1 for s in plan.seqs]
        if not self.allocator.has(sum(p // bs >= len(s.blocks) for s, p in zip(plan.seqs, p0))):
            return None
        positions, slots_map, ctx, tables, row_adapters = [], [], [], [], []
        for seq, p in zip(plan.seqs, p0):
            if p // bs >= len(seq.blocks):
                seq.blocks += self.allocator.allocate(1, seq)
            positions.append(p)
            slots_map.append(seq.blocks[p // bs] * bs + p % bs)
            ctx.append(p + 1)
            tables.append(seq.blocks)
            row_adapters.append(seq.req.adapter)
        ahead = Lookahead(list(plan.seqs), p0, positions, slots_map, ctx, tables, row_adapters)
        if self.graphs is not None and self.graphs.fits(n, max(len(t) for t in tables)):
            # queued on the compute stream behind this iteration: the graph reads them next time
            self.graphs.stage(positions, slots_map, tables, ctx)
            ahead.staged = True
        return ahead

    def _only_running(self, n: int) -> bool:
        """``n`` rows are all the running rows and the next schedule admits none: no waiting row,
        or no free seat (``schedule``'s admission condition, budget aside)."""
        return n == len(self.running) and not (self.waiting and n < self.max_num_seqs)

    def _take(self, ahead: Lookahead) -> IterationPlan | None:
        """The plan ``schedule`` would return now, if it is the looked-ahead iteration: the same
        rows, all running, each with exactly one new token at the expected position, no other
        row running and none that could be admitted. Else None (the caller schedules)."""
        n = len(ahead.seqs)
        if not self._only_running(n):
            return None
        for seq, p in zip(ahead.seqs, ahead.p0):
            if not seq.is_running or seq.num_computed != p or len(seq.tokens) != p + 1:
                return None
        self.lookahead_used += 1
        return IterationPlan.decode_only(ahead.seqs)

    def _advance(self, plan: IterationPlan, logits: torch.Tensor) -> list[Result]:
        if self.lookahead:  # before sampling waits for the device: this host work overlaps its forward
            self._next = self._look_ahead(plan)
        sampled = [s for s, flag in zip(plan.seqs, plan.sample) if flag]
        if self.device_wait_hook is not None:
            self.device_wait_hook()
        toks = self._chain(logits) if self.chain and self._next is not None else None
        if toks is None:
            toks = sample(logits, self.sampling, [s.key for s in sampled], [s.num_generated for s in sampled])
        # a chained iteration's rows that finished while it ran (at the iteration before) are
        # no longer running: their rows were computed, their tokens are dropped
        for seq, n in zip(plan.seqs, plan.new_tokens):
            if seq.is_running:
                seq.num_computed += n
        done: list[Result] = []
        for seq, tok in zip(sampled, toks):
            if not seq.is_running:
                continue
            self.stats["generated_tokens"] += 1
            reason = self._append(seq, tok)
            if reason:
                done.append(self._finish(seq, reason))
        return done

    def _chain(self, logits: torch.Tensor) -> list[int] | None:
        """Launch the looked-ahead iteration (``self._next``: this one's rows, one token each)
        now, its token ids this iteration's greedy tokens taken on the device, and return this
        iteration's tokens, read after that launch: the device then runs the next iteration
        while the host appends these tokens, checks stops and finishes rows, instead of
        waiting for the host between iterations (0.37 ms of a 12.05 ms 256-row iteration and
        0.28 of 6.39 at 64 rows on the H200, ``scripts/profile_batch.py --graphs``, twenty-fifth
        session). The next step takes the launched iteration as its plan (``_inflight``); a row
        that finishes here was computed there too and its token is dropped (its KV write lands in
        its own freed block, before any later forward on the stream can reuse it). The launch
        skips ``_ensure`` and the bank's context: the rows, their adapters, leases and slots are
        the last launch's, and so are the graph's LoRA buffers. None (the
        caller samples as usual) unless the lookahead's inputs are staged in the decode graphs and
        sampling is greedy (the device's argmax is then exactly ``sample``'s choice)."""
        ahead = self._next
        if not ahead.staged or not self.sampling.greedy:
            return None
        self._next = None  # consumed here, not by the next step's _take
        plan = IterationPlan.decode_only(ahead.seqs)
        next_logits, tokens = self.graphs.chain(logits, len(plan.seqs))
        self._inflight = (plan, next_logits)
        self._count(plan)
        self.lookahead_used += 1
        self.chained += 1
        return tokens()

    def _append(self, seq: Sequence, tok: int) -> str | None:
        """Add a sampled token; return the finish reason if the row is done."""
        if tok in self.eos:
            return "stop"  # the EOS token itself is not part of the completion
        seq.tokens.append(tok)
        if self.stop_strings:
            text = self.detokenize(seq.generated)
            cut = min((i for i in (text.find(s) for s in self.stop_strings) if i >= 0), default=-1)
            if cut >= 0:
                seq.text = text[:cut]
                return "stop"
        if seq.num_generated >= seq.req.max_new_tokens or len(seq.tokens) >= self.max_context:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> Result:
        self._drop(seq)
        r = seq.req
        return Result(r.row, r.id, r.adapter, seq.generated, reason, len(r.prompt_ids), text=seq.text)

    def drain(self) -> list[Result]:
        """Run until every queued request finished."""
        out: list[Result] = []
        while self.has_work():
            before = (len(self.waiting), len(self.running))
            out += self.step()
            if not self.running and self.waiting and (len(self.waiting), len(self.running)) == before:
                seq = self.waiting.popleft()  # cannot be admitted even into an empty engine: a bug guard
                out.append(Result(seq.req.row, seq.req.id, seq.req.adapter, [], "error", len(seq.req.prompt_ids),
                                  "E_ENGINE_STUCK", "the engine could not admit this row into an empty batch"))
        return out


def stored_adapter_bytes(pinned) -> int:
    """Bytes of an adapter's factors as stored (what a load moves)."""
    return sum(m.a.nbytes + m.b.nbytes for m in pinned.modules)
