"""Which rows run in the next iteration: admission, KV blocks, preemption, the iteration plan.

Owns scheduler state (docs/design.md, Iteration plan): the waiting queue, the
running sequences and their KV blocks. Each iteration it continues the running
rows (decodes first, then prefill chunks, under a ``max_batch_tokens`` budget)
and admits waiting rows while seats, KV blocks, the budget and adapter slots
allow, adapter-aware and starvation-bounded (docs/design.md, Schedule window):
rows whose adapter needs no load go first, a row whose adapter cannot get a slot
is overtaken by at most ``max_wait`` later rows, then strict arrival order
applies. When the cache runs out, the latest admitted row is preempted and
later recomputed (docs/design.md, Preemption). With the prefix cache, a row
admitted takes the cached chain of its blocks and computes the rest, and rows
that begin alike are admitted together (``sharing.PrefixSharing``; docs/batch.md,
Prefix cache). The plan packs prefill rows first, then decode rows
(docs/design.md, ``doff`` and ``prefill_indptr``).

Must not touch tensors or the model: its only side effects are KV blocks,
leases, and the loads it starts for rows it admits (through the bank and
``loads.AdapterLoads``).

Invariants: a sequence is in exactly one of waiting / running / finished; the
adapters of the running sequences are never more than the bank's slots, so
``ensure`` never has to evict an adapter in use; a preempted sequence keeps its
generated tokens and recomputes its KV (same tokens, same random stream).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from mlora.batch.config import EngineConfig
from mlora.batch.engine.loads import AdapterLoads
from mlora.batch.engine.sequence import Request, Sequence
from mlora.batch.engine.sharing import PrefixSharing
from mlora.batch.engine.waiting import WaitingQueue
from mlora.batch.model.kvcache import KVCacheFull
from mlora.batch.model.prefixcache import PrefixCache


@dataclass
class IterationPlan:
    """One model invocation (docs/design.md, Iteration plan): packed rows, phase-major."""

    seqs: list[Sequence]
    new_tokens: list[int]  # rows of each sequence in this iteration
    sample: list[bool]  # does this sequence's last row get sampled
    prefill_indptr: list[int]  # row offsets of the prefill sequences
    doff: int  # first decode row

    @property
    def num_rows(self) -> int:
        return sum(self.new_tokens)

    @classmethod
    def decode_only(cls, seqs: list[Sequence]) -> "IterationPlan":
        """One new row per sequence, every row sampled, no prefill (a looked-ahead iteration)."""
        n = len(seqs)
        return cls(seqs=list(seqs), new_tokens=[1] * n, sample=[True] * n, prefill_indptr=[0], doff=0)

    @classmethod
    def packed(cls, chosen: list[tuple[Sequence, int]]) -> "IterationPlan":
        """The plan of ``chosen`` (sequence, new rows): prefill rows first, then decode rows."""
        prefill, decode = [], []
        for s, n in chosen:
            (decode if s.num_computed > 0 and len(s.tokens) - s.num_computed == 1 else prefill).append((s, n))
        ordered = prefill + decode
        indptr = [0]
        for _, n in prefill:
            indptr.append(indptr[-1] + n)
        return cls(seqs=[s for s, _ in ordered], new_tokens=[n for _, n in ordered],
                   sample=[s.num_computed + n == len(s.tokens) for s, n in ordered],
                   prefill_indptr=indptr, doff=indptr[-1])


@dataclass
class _Pass:
    """One admission pass's view of the adapter slots. ``active``: adapters whose slot the
    pass counts as taken (running rows', those admitted or whose load started in this pass,
    and with asynchronous loads those published for waiting rows); ``busy``: of those, the
    ones that must stay as they are in this pass (an adapter published for waiting rows but
    held by no row is idle: a load may evict it); ``loading``: adapters whose load this pass
    started or found in flight (their rows wait)."""

    now: int  # admissions so far: a row's wait is the number admitted since it arrived
    aged: bool  # some waiting row has waited max_wait admissions: strict queue order
    active: set[str]
    busy: set[str]
    loading: set[str] = field(default_factory=set)


class Scheduler:
    """Admission and the iteration plan over ``allocator``'s KV blocks and ``bank``'s
    ``num_slots`` adapter slots (``joint``: the KV blocks are the bank's ledger pages;
    ``async_loads``: admission starts cold adapters' loads and runs their rows once
    published)."""

    def __init__(self, config: EngineConfig, allocator, bank, pinned: dict, loads: AdapterLoads, *,
                 num_slots: int, joint: bool, async_loads: bool, metrics=None, prefix: PrefixCache | None = None):
        self.block_size, self.max_num_seqs = config.block_size, config.max_num_seqs
        self.max_batch_tokens = config.max_batch_tokens
        self.max_wait = config.schedule_window  # later rows that may be admitted before a waiting row blocks admission
        self.allocator, self.bank, self.pinned, self.loads, self.metrics = allocator, bank, pinned, loads, metrics
        self.num_slots, self.joint, self.async_loads = num_slots, joint, async_loads
        self.waiting = WaitingQueue()  # rows in queue order, with the number per adapter
        self.running: list[Sequence] = []
        self.admissions = 0
        self.preemptions = 0
        # the prefix cache (``allocator`` itself when on): full blocks shared by content
        self.sharing = PrefixSharing(prefix, self.block_size, pinned) if prefix is not None else None
        self.prompt_reused = self.prompt_computed = 0  # prompt tokens at first admission: cached / to compute

    # ---- the queue -------------------------------------------------------------------

    def enqueue(self, req: Request, key: int, adapter: str | None = None, activation: int | None = None) -> None:
        """Queue ``req`` to run with ``adapter`` (None: the base), from position ``activation`` on
        for an aLoRA adapter (None: from position 0)."""
        seq = Sequence(req, key, list(req.prompt_ids), arrival=self.admissions, adapter=adapter,
                       active_from=activation or 0)
        if self.sharing is not None:
            self.sharing.enter(seq)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def only_running(self, n: int) -> bool:
        """``n`` rows are all the running rows and the next schedule admits none: no waiting row,
        or no free seat (:meth:`schedule`'s admission condition, budget aside)."""
        return n == len(self.running) and not (self.waiting and n < self.max_num_seqs)

    def drop(self, seq: Sequence) -> None:
        """Take a sequence out of the running set: its adapter lease and KV blocks go back."""
        if seq.lease is not None:
            self.bank.release(seq.lease)
            seq.lease = None
        self.running.remove(seq)
        seq.is_running = False
        if self.sharing is not None:
            self.sharing.forget(seq)
        self.allocator.free(seq.blocks, seq)
        seq.blocks = []

    def remove_adapter(self, adapter_id: str) -> list[Sequence]:
        """Every running and waiting row naming ``adapter_id``, taken out of the engine."""
        out = []
        for seq in [s for s in self.running if s.adapter == adapter_id]:
            self.drop(seq)
            out.append(seq)
        return out + self.waiting.take_if(lambda s: s.adapter == adapter_id)

    # ---- the plan --------------------------------------------------------------------

    def schedule(self) -> IterationPlan | None:
        """The next iteration: the running rows' next tokens, then admitted rows; None if no row can run."""
        chosen, budget = self._continue_running(self.max_batch_tokens)
        if self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            budget = self._admit(chosen, budget)
        return IterationPlan.packed(chosen) if chosen else None

    def _continue_running(self, budget: int) -> tuple[list[tuple[Sequence, int]], int]:
        """(running sequences with their new rows, budget left): decodes first (one row each),
        then prefill chunks (a stable partition; a sequence's pending count does not change in
        this loop unless it is preempted), each holding KV blocks for its rows."""
        chosen: list[tuple[Sequence, int]] = []
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
        return [(s, n) for s, n in chosen if s.is_running], budget  # preempted ones dropped

    def take(self, seqs: list[Sequence], p0: list[int]) -> IterationPlan | None:
        """The plan :meth:`schedule` would return now, if it is the looked-ahead iteration of
        ``seqs`` at positions ``p0``: the same rows, all running, each with exactly one new
        token at the expected position, no other row running and none that could be admitted.
        Else None (the caller schedules)."""
        if not self.only_running(len(seqs)):
            return None
        for seq, p in zip(seqs, p0):
            if not seq.is_running or seq.num_computed != p or len(seq.tokens) != p + 1:
                return None
        return IterationPlan.decode_only(seqs)

    def grow_ahead(self, plan: IterationPlan) -> list[int] | None:
        """The positions of the next iteration if it is "every row of this decode-only
        iteration, one more token each" (None when this iteration is not decode-only, other
        rows run or could be admitted, or a row would need a block the cache does not have
        free). Rows that will need a new KV block get it now: the schedule would give it to
        them anyway, and a row that finishes instead frees it with its others."""
        n = len(plan.seqs)
        if plan.doff != 0 or n > self.max_batch_tokens or not all(plan.sample) or not self.only_running(n):
            return None
        bs = self.block_size
        p0 = [s.num_computed + 1 for s in plan.seqs]
        if not self.allocator.has(sum(p // bs >= len(s.blocks) for s, p in zip(plan.seqs, p0))):
            return None
        for seq, p in zip(plan.seqs, p0):
            if p // bs >= len(seq.blocks):
                seq.blocks += self.allocator.allocate(1, seq)
        return p0

    # ---- admission -------------------------------------------------------------------

    def _admit(self, chosen: list, budget: int) -> int:
        """Admit waiting sequences into ``chosen``; returns the budget left. A row whose
        adapter cannot run now is skipped, unless it has waited ``max_wait`` admissions:
        then nobody overtakes it (docs/design.md, Schedule window)."""
        if budget <= 0 or len(self.running) >= self.max_num_seqs or not self.waiting:
            return budget  # nothing can be admitted: skip the ordering work (the steady decode state)
        p = self._open_pass()
        admitted = []
        for seq in self._candidates(p):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if not self._ready(seq, p, bool(chosen)):
                if p.aged and p.now - seq.arrival >= self.max_wait:  # an aged row that waits: nobody overtakes it
                    break
                continue
            if self.sharing is not None and not seq.blocks and not self.sharing.match(seq):
                continue  # a running row computes its next block now: it waits to share it
            n = min(seq.pending, budget)
            if not self._seat(seq, n):
                if self.sharing is not None:
                    self.sharing.unmatch(seq)
                break
            chosen.append((seq, n))
            budget -= n
            admitted.append(seq)
            if seq.adapter is not None:
                p.active.add(seq.adapter)
                p.busy.add(seq.adapter)
        self.waiting.discard(admitted)
        return budget

    def _open_pass(self) -> _Pass:
        active = {s.adapter for s in self.running if s.adapter is not None}
        busy = set(active)
        if self.async_loads:  # adapters loaded for waiting rows (asynchronous loads) hold their slots: run them
            active |= self._resident_waiting_adapters()
        now = self.admissions
        return _Pass(now, now - self.waiting.min_arrival() >= self.max_wait, active, busy)

    def _candidates(self, p: _Pass):
        """The rows one pass considers, in the order it considers them. Aged: the whole queue
        in strict queue order. Else only rows this pass can admit: base rows, rows of active
        adapters and of the new adapters the free slots go to (:meth:`slot_plan`'s small and
        big; the rest cannot get a slot in this pass), sorted (:meth:`_slot_order`). A pass
        admits at most ``seats`` rows, and once it skips a row of an adapter it skips the rest
        of that adapter's rows: the first ``seats`` rows of each are all it can use, whatever
        the scheduling window holds."""
        if p.aged:
            return self.waiting
        order, admissible = self._slot_order(p.active)
        seats = self.max_num_seqs - len(self.running)
        candidates = self.waiting.rows_of(None, seats)
        for a in admissible:
            candidates += self.waiting.rows_of(a, seats)
        position = self.waiting.position
        candidates.sort(key=lambda s: (order(s), s.group, position(s)))
        return candidates

    def _ready(self, seq: Sequence, p: _Pass, anything_chosen: bool) -> bool:
        """Whether ``seq`` may take a seat in this pass: its adapter (if any) has a slot or gets
        one, and is published or loads inside ``ensure``."""
        a = seq.adapter
        if a is None:
            return True
        if a in p.loading:
            return False
        if a not in p.busy:
            if a in p.active:  # published for waiting rows: its slot is there if the pass has room
                full = len(p.busy) >= self.num_slots
            else:  # cold: needs a free slot. An aged row may also take the slot of an idle adapter
                # that only waiting rows name (otherwise, with every slot idle that way, it would
                # wait for rows it does not let pass: a deadlock with many adapters and few slots)
                held = p.aged and p.now - seq.arrival >= self.max_wait
                full = len(p.active) >= self.num_slots and not (held and len(p.busy) < self.num_slots)
            if full:
                return False
        # joint memory ledger: cold is "not published now" (KV admitted earlier in this pass may
        # have evicted an idle adapter counted active), and every cold load starts here, so that
        # it holds its slot's pages before later rows' KV can take them
        cold = not self._published(a) if self.joint else a not in p.active
        if cold and self.async_loads and (anything_chosen or self.running or self.joint):
            return self._load_ahead(a, p)
        return True

    def _load_ahead(self, adapter: str, p: _Pass) -> bool:
        """Start a cold adapter's load now (the copy overlaps this iteration) and run its rows
        once it is published: False (the row waits). True where the row may be admitted now:
        the load is not started ahead but happens in ``ensure`` (with nothing else to run, the
        blocking way keeps every iteration making progress), or, with the joint ledger, the
        rare "sync" answer was loaded here, blocking, so that it holds its slot's pages before
        this pass's KV."""
        status = self.bank.start_load(adapter, self.pinned)
        if status in ("started", "loading", "building") or (self.joint and status == "no-room"):
            if status in ("started", "loading"):
                p.active.add(adapter)  # its slot is taken
                p.busy.add(adapter)
                p.loading.add(adapter)
            return False  # joint, no room: no slot's pages are free now (KV holds them); wait
        if self.joint and status == "sync":
            return self.loads.load_now(adapter)  # False: no slot's pages to be had now
        return True

    def _seat(self, seq: Sequence, n: int) -> bool:
        """Admit ``seq`` with ``n`` rows: its KV blocks and (joint ledger) the lease that keeps
        its published adapter from being evicted by later rows' KV. False, nothing taken, when
        the blocks are not there."""
        a = seq.adapter
        blocks = self.blocks_needed(seq, n)
        lease = None
        if self.joint and a is not None and seq.lease is None and self._published(a):
            # bound first: this row's KV (and later rows') must not evict it as an idle adapter
            lease = f"row{seq.req.row}"
            self.bank.residency.acquire(lease, self.pinned[a].semantic_sha256)  # published: no load, no count
        if not self.allocator.has(blocks):
            if lease is not None:
                self.bank.release(lease)
            return False
        if seq.admitted == 0:
            self._first_admission(seq)
        self.admissions += 1
        seq.admitted = self.admissions
        self.running.append(seq)
        seq.is_running = True
        seq.lease = seq.lease or lease
        seq.blocks += self.allocator.allocate(blocks, seq)
        if self.sharing is not None:
            self.sharing.seated(seq)
        return True

    def _first_admission(self, seq: Sequence) -> None:
        """Count a row's prompt tokens, taken from the prefix cache or to compute, and leave its
        first-block group."""
        reused = seq.num_computed
        computed = len(seq.req.prompt_ids) - reused
        self.prompt_reused += reused
        self.prompt_computed += computed
        if self.metrics:
            self.metrics.prefix_admission(reused, computed)
        if self.sharing is not None:
            self.sharing.leave_group(seq)

    def publish(self, seq: Sequence) -> None:
        """Enter the row's newly computed full blocks into the prefix cache (when it is on)."""
        if self.sharing is not None:
            self.sharing.publish(seq)

    def _published(self, adapter: str) -> bool:
        """Whether the bank has a published generation of ``adapter`` now (joint memory ledger)."""
        return self.pinned[adapter].semantic_sha256 in self.bank.residency.catalog

    def _resident_waiting_adapters(self) -> set[str]:
        """Adapters that some waiting row names and whose generation is published in the
        bank (in time proportional to the distinct waiting adapters, not to the queue)."""
        resident = self.bank.resident
        pinned = self.pinned
        return {a for a in self.waiting.counts if a in pinned and pinned[a].semantic_sha256 in resident}

    # ---- adapter slots ---------------------------------------------------------------

    def slot_plan(self, active: set) -> tuple[Counter, list[str], list[str], list[str]]:
        """(waiting rows per adapter, small, big, rest): how one admission pass gives out
        the free adapter slots.

        The free slots are split between the new adapters with the most waiting rows,
        as many as it takes to fill the free row capacity (``big``, most rows first),
        and, for the slots left, the adapters with the fewest (``small``, fewest
        first); ``rest`` are the other new adapters, fewest rows first. An adapter
        with one or two rows holds a slot as long as one with fifty does, so rare
        adapters run alongside the popular ones from the start instead of being left
        for a tail in which every slot holds a row or two."""
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
        (:meth:`slot_plan`); the set holds ``active`` plus small and big (the other adapters
        get no slot in this pass, and their rows are not candidates)."""
        waiting_rows, small, big, _ = self.slot_plan(active)
        key_of = {a: (0, waiting_rows[a]) for a in small}
        key_of.update((a, (2, -waiting_rows[a])) for a in big)
        # base rows and active adapters: (1, 0); second: the adapters a row may be admitted with
        return (lambda seq: key_of.get(seq.adapter, (1, 0))), active.union(small, big)

    def prefetch_plan(self, depth: int) -> tuple[list[str], set[str]]:
        """(the next ``depth`` cold adapters among the waiting rows, in the order admission will
        bring them in: small, big, then the rest; the small and big ones, which the next
        admission gives slots to)."""
        active = {s.adapter for s in self.running if s.adapter is not None}
        resident = set(self.bank.resident)
        _, small, big, rest = self.slot_plan(active)
        cold: list[str] = []
        for a in small + big + rest:
            p = self.pinned.get(a)
            if p is None or not p.ok or p.semantic_sha256 in resident:
                continue
            cold.append(a)
            if len(cold) >= depth:
                break
        return cold, set(small + big)

    # ---- KV blocks -------------------------------------------------------------------

    def blocks_needed(self, seq: Sequence, n: int) -> int:
        return max(0, -(-(seq.num_computed + n) // self.block_size) - len(seq.blocks))

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Blocks for ``n`` more tokens of a running sequence, preempting the latest
        admitted other sequences (recompute) when the cache is full."""
        need = self.blocks_needed(seq, n)
        if need == 0:  # most decode steps: the last block has room
            return True
        while not self.allocator.has(need):
            victims = [s for s in self.running if s is not seq]
            if not victims:
                return False
            self._preempt(max(victims, key=lambda s: s.admitted))
        try:
            seq.blocks += self.allocator.allocate(need, seq)
        except KVCacheFull:
            return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        if self.metrics:
            self.metrics.preemption()
        self.drop(seq)
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.preemptions += 1
