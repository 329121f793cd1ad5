"""The generation engine: continuous batching over a paged KV cache, one model on one device.

Owns the loop that composes the engine's rooms: requests in (``add``), one
iteration per ``step``, results out in completion order (the job runner puts
them back in input order). Per iteration::

    schedule  -> IterationPlan          scheduler.py: admission, KV blocks, preemption
    forward   -> logits of sample rows  executor.py: inputs, adapters' slots, model or decode graph
    advance   -> tokens, finished rows  sampling (or chained decode), stop rules (sequence.py)

Rows live in sequence.py, adapter loads and their metrics in loads.py, the KV
cache's memory in joint.py, decode graphs in graphs.py.
"""

from __future__ import annotations

import dataclasses
import time

from mlora.batch.adapters.catalog import AdapterError
from mlora.batch.config import EngineConfig
from mlora.batch.engine.executor import Executor, Lookahead
from mlora.batch.engine.graphs import DecodeGraphs
from mlora.batch.engine.joint import kv_memory
from mlora.batch.engine.loads import AdapterLoads, stored_adapter_bytes
from mlora.batch.engine.sampling import row_key
from mlora.batch.engine.scheduler import IterationPlan, Scheduler
from mlora.batch.engine.sequence import Decoding, Request, Result, Sequence, error_result, refusal
from mlora.batch.model.prefix import alora_activation_start
from mlora.batch.model.prefixcache import PrefixCache

__all__ = ["Decoding", "Engine", "IterationPlan", "Request", "Result", "Sequence", "stored_adapter_bytes"]


class Engine:
    """Requests of ``pinned``'s adapters (served from ``bank``, or None: base rows only) on
    ``model``, with the choices of ``config`` (``cuda_graphs`` as resolved for this device)
    and ``num_blocks`` KV blocks.

    ``decoding``: sampling, stop strings, detokenizer. ``metrics``: a
    ``mlora.batch.job.metrics.JobMetrics`` or None. ``arena`` (an ``arena.PageArena``
    whose pages ``bank``, a ResidencyBank, was carved from): the joint memory ledger, KV
    blocks from the bank's ledger (``num_blocks`` must be the arena's ledger pages) and cold
    adapters always loaded asynchronously (a load reserves its slot's pages when the row is
    admitted). ``async_loads`` (None: on a GPU): admission starts a cold adapter's load and
    runs its rows once it is published, so the copy overlaps the iteration in flight
    (docs/design.md, Prefetch); on the CPU copies are synchronous and deferring rows gains
    nothing. Decode is chained (docs/design.md, Chained decode) wherever it applies: with
    lookahead and decode graphs, not with the joint ledger. ``tp`` (a ``tpfollow.Leader``): the
    model is rank 0's part of a tensor-parallel group, whose other ranks run every forward too."""

    def __init__(self, model, bank, pinned: dict, config: EngineConfig, *, num_blocks: int,
                 decoding: Decoding = Decoding(), metrics=None, arena=None, async_loads: bool | None = None,
                 tp=None):
        self.model, self.bank, self.pinned, self.metrics, self.decoding = model, bank, pinned, metrics, decoding
        self.eos = set(model.config.eos_token_ids)
        self.max_context = model.config.max_position_embeddings
        self.block_size, self.num_blocks = config.block_size, num_blocks
        self.joint = arena is not None
        # with CUDA graphs one extra block, owned by no sequence, takes the padded rows' K/V
        self.kv, self.allocator, self.max_row_blocks = kv_memory(model, bank, arena, num_blocks, config.block_size,
                                                                 config.cuda_graphs)
        # the prefix cache gives out the blocks (not with the joint ledger, whose pages have one owner each)
        self.prefix = PrefixCache(self.allocator) if config.prefix_cache and not self.joint else None
        if self.prefix is not None:
            self.allocator = self.prefix
        self.alora_without_invocation = config.alora_without_invocation
        graphs = None
        if config.cuda_graphs:
            graphs = DecodeGraphs(model, self.kv, bank, config.max_num_seqs, scratch_slot=num_blocks * config.block_size)
        self.num_slots = bank.num_slots if bank is not None else 0
        loads_ahead = bank is not None and bank.loads_ahead
        # cold adapters of the waiting rows whose host images are built ahead, in the background
        self.prefetch_depth = config.prefetch_adapters if loads_ahead else 0
        # ... and of those, how many may start loading into free or unneeded GPU slots per iteration
        self.prefetch_gpu = config.prefetch_gpu_adapters if self.prefetch_depth else 0
        if async_loads is None:
            async_loads = model.device.type == "cuda"
        if self.joint:  # a load must hold its slot's pages from admission on (KV could take them)
            async_loads = True
        self.async_loads = async_loads and bool(self.prefetch_gpu)
        self.loads = AdapterLoads(bank, pinned, metrics)
        self.scheduler = Scheduler(config, self.allocator, bank, pinned, self.loads, num_slots=self.num_slots,
                                   joint=self.joint, async_loads=self.async_loads, metrics=metrics, prefix=self.prefix)
        self._reported = (0, 0, 0, 0)  # the prefix cache's counters last handed to the metrics
        self._shared_peak = 0
        self.lookahead = config.lookahead
        # not with the joint memory ledger: a row that finishes while the chained iteration runs
        # frees KV pages the ledger may hand to an adapter load on another stream at once
        self.chain = self.lookahead and graphs is not None and not self.joint
        self.executor = Executor(model, self.kv, graphs, bank, pinned, self.loads, sampling=decoding.sampling,
                                 chain=self.chain, tp=tp)
        self.generated_tokens = 0

    # ---- requests ------------------------------------------------------------------

    def add(self, req: Request) -> Result | None:
        """Queue a request; a request that can never run is returned at once as an error Result."""
        err = refusal(req, self.pinned, max_context=self.max_context, block_size=self.block_size,
                      max_row_blocks=self.max_row_blocks)
        if err:
            return error_result(req, *err)
        adapter, activation = req.adapter, None
        invocation = self.pinned[adapter].invocation_tokens if adapter is not None else None
        if invocation:  # aLoRA: the adapter runs from its invocation's last occurrence on
            activation = alora_activation_start(req.prompt_ids, invocation)
            if activation is None:
                if self.alora_without_invocation != "base":
                    return error_result(req, "E_ALORA_NO_INVOCATION", (
                        f"the prompt does not hold adapter {adapter!r}'s invocation token ids {list(invocation)} "
                        "(an activated LoRA runs from them on): add the invocation to the prompt, or pass "
                        "--alora-without-invocation base to run such rows on the base model as PEFT does"))
                adapter = None  # the base model, as PEFT runs it
                if self.metrics:
                    self.metrics.alora_without_invocation()
        self.scheduler.enqueue(req, row_key(self.decoding.sampling.seed, req.id), adapter, activation)
        return None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_queued(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self.executor.graphs

    @property
    def adapters_used(self) -> frozenset[str]:
        """Adapters some row of this engine has run with (the job counts each one's bytes once)."""
        return frozenset(self.loads.seen)

    @property
    def lookahead_used(self) -> int:
        """Iterations that ran on inputs built during the one before."""
        return self.executor.lookahead_used

    @property
    def chained(self) -> int:
        """Of those, iterations launched before the iteration ahead of them was sampled."""
        return self.executor.chained

    @property
    def stats(self) -> dict:
        x, sc = self.executor, self.scheduler
        return dict(iterations=x.iterations, prefill_tokens=x.prefill_tokens, decode_tokens=x.decode_tokens,
                    generated_tokens=self.generated_tokens, preemptions=sc.preemptions,
                    prefill_tokens_computed=sc.prompt_computed, prefill_tokens_reused=sc.prompt_reused)

    @property
    def prefix_stats(self) -> dict | None:
        """The prefix cache's job totals (None when it is off)."""
        if self.prefix is None:
            return None
        st = self.prefix.stats
        return dict(hit_blocks=st.hit_blocks, looked_up_blocks=st.looked_up_blocks, evictions=st.evictions,
                    published=st.published, shared_blocks_peak=self._shared_peak)

    # ---- one iteration ---------------------------------------------------------------

    def schedule(self) -> IterationPlan | None:
        """The next iteration's plan (the scheduler's), or None when no row can run now."""
        return self.scheduler.schedule()

    def step(self) -> list[Result]:
        """Run one iteration; return the rows that finished in it."""
        if self.prefetch_gpu:  # GPU-tier prefetch (and async_loads, which needs it) starts loads ahead
            self.bank.end_invocation()
            self.loads.commit()  # loads started during the last iteration: published now, so
            # every slot this schedule counts on is published or free (an uncommitted load would
            # hold a slot admission does not see: E_ADMISSION_CAPACITY in ensure)
        inflight = self.executor.take_inflight()
        if inflight is not None:  # launched by the last step (chained decode): its rows, one token each
            plan, logits = inflight
            t0 = time.perf_counter()
        else:
            plan, ahead = self._plan()
            if plan is None:
                return []
            t0 = time.perf_counter()
            try:
                logits = self.executor.forward(plan, ahead)
            except AdapterError as exc:  # e.g. its bytes changed since the job started: never served
                if self.metrics:
                    self.metrics.adapter_load(0, time.perf_counter() - t0, ok=False, tier_from="disk")
                return self._fail_adapter(exc.adapter_id, exc.code, str(exc).split(": ", 1)[-1])
        # host work for later iterations, done while the device runs this one (the sampled
        # tokens are read in _advance): eviction ranking and prefetch of coming adapters
        if self.bank is not None:  # eviction keeps adapters that waiting rows still need
            self.bank.want(self.scheduler.waiting.adapters(), self.pinned)
        if self.prefetch_depth:
            self.loads.prefetch(*self.scheduler.prefetch_plan(self.prefetch_depth), self.prefetch_gpu)
        record = self._iteration_record(plan) if self.metrics else None  # before _advance waits for the device
        done = self._advance(plan, logits)
        if record is not None:
            self.metrics.iteration(*record, time.perf_counter() - t0)
        if self.prefix is not None:
            self._prefix_report()
        return done

    def _prefix_report(self) -> None:
        """The shared-block peak, and the prefix cache's counters since the last report to the metrics."""
        shared = self.prefix.num_shared
        self._shared_peak = max(self._shared_peak, shared)
        if self.metrics:
            st = self.prefix.stats
            now = (st.looked_up_blocks, st.hit_blocks, st.evictions, st.published)
            if now != self._reported or shared:
                d = [a - b for a, b in zip(now, self._reported)]
                self.metrics.prefix_cache(looked_up=d[0], hit=d[1], evicted=d[2], published=d[3], shared=shared)
                self._reported = now

    def _plan(self) -> tuple[IterationPlan | None, Lookahead | None]:
        """(the plan of the iteration to launch now, or None; its inputs if they were built
        during the iteration before, else None)."""
        ahead = self.executor.take_ahead()
        plan = self.scheduler.take(ahead.seqs, ahead.p0) if ahead is not None else None
        if plan is not None:
            self.executor.lookahead_used += 1
        else:
            ahead = None
            plan = self.schedule()
        if plan is None and self.async_loads and self.bank.loads_in_flight():
            self.loads.commit()  # every waiting row waits for a load: wait for them here
            plan = self.schedule()
        return plan, ahead

    def _advance(self, plan: IterationPlan, logits) -> list[Result]:
        """Sample the plan's rows (``logits``: its sample rows'), append their tokens and
        finish the rows that are done; the next iteration's inputs are built first, while the
        device still runs this one (with lookahead)."""
        if self.lookahead:
            p0 = self.scheduler.grow_ahead(plan)
            if p0 is None:
                self.executor.ahead = None
            else:
                self.executor.build_ahead(plan, p0)
        sampled = [s for s, flag in zip(plan.seqs, plan.sample) if flag]
        toks = self.executor.tokens(sampled, logits)
        # a chained iteration's rows that finished while it ran (at the iteration before) are
        # not running: their rows were computed, their tokens are dropped
        for seq, n in zip(plan.seqs, plan.new_tokens):
            if seq.is_running:
                seq.num_computed += n
                self.scheduler.publish(seq)
        done: list[Result] = []
        for seq, tok in zip(sampled, toks):
            if not seq.is_running:
                continue
            self.generated_tokens += 1
            reason = self.decoding.append(seq, tok, self.eos, self.max_context)
            if reason:
                self.scheduler.drop(seq)
                done.append(seq.result(reason))
        return done

    def _iteration_record(self, plan: IterationPlan) -> tuple[int, int, int, int, int]:
        """The iteration metrics' figures but its time: (prefill rows, decode rows, distinct
        adapters, true rank rows, padded rank rows); rank rows use each adapter's largest
        module rank (true) against the bank's physical rank (padded)."""
        true = padded = 0
        distinct = set()
        for seq, n in zip(plan.seqs, plan.new_tokens):
            a = seq.adapter
            if a is None:
                continue
            distinct.add(a)
            true += n * self.pinned[a].max_rank
            padded += n * self.bank.max_rank
        return plan.doff, plan.num_rows - plan.doff, len(distinct), true, padded

    def _fail_adapter(self, adapter_id: str | None, code: str, message: str) -> list[Result]:
        """Retire an adapter that cannot be served (e.g. its bytes changed since the job
        started): every queued row that names it becomes an error row; the other rows continue."""
        if adapter_id is None:
            raise RuntimeError(f"{code}: {message}")
        p = self.pinned.get(adapter_id)
        if p is not None:
            self.pinned[adapter_id] = dataclasses.replace(p, ok=False, error_code=code, error_message=message, modules=())
        return [error_result(seq.req, code, message) for seq in self.scheduler.remove_adapter(adapter_id)]

    def drain(self) -> list[Result]:
        """Run until every queued request finished."""
        out: list[Result] = []
        waiting, running = self.scheduler.waiting, self.scheduler.running
        while self.has_work():
            before = (len(waiting), len(running))
            out += self.step()
            if not running and waiting and (len(waiting), len(running)) == before:
                seq = waiting.popleft()  # cannot be admitted even into an empty engine: a bug guard
                out.append(error_result(seq.req, "E_ENGINE_STUCK", "the engine could not admit this row into an "
                                        "empty batch"))
        return out
