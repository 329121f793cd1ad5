"""Running one iteration on the device: its packed inputs, the forward, sampling, and the
decode iterations built or launched ahead.

Owns iteration state (docs/design.md, Iteration plan) from the plan on: the
packed host inputs (token ids, positions, KV cache slots, query starts, context
lengths, block tables, sample rows, each row's adapter), the adapters' slots and
leases for the invocation (through ``loads.AdapterLoads`` and the bank), the
model forward or a decode graph's replay (``graphs.DecodeGraphs``), and the
choice of each sample row's token. Two ways to keep the device busy between
decode iterations:

* lookahead (docs/design.md, Lookahead): while the device runs a decode-only
  iteration, the next one's inputs ("the same rows, one more token each") are
  built and staged into the decode graphs' buffers; the next step uses them
  when the schedule is exactly that iteration;
* chained decode (docs/design.md, Chained decode): with those inputs staged and
  greedy sampling, the looked-ahead iteration is launched from the device's own
  argmax before this iteration's tokens are read.

Must not choose rows or give out KV blocks: the scheduler does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlora.batch.engine.graphs import DecodeGraphs
from mlora.batch.engine.loads import AdapterLoads
from mlora.batch.engine.sampling import SamplingParams, sample
from mlora.batch.engine.scheduler import IterationPlan
from mlora.batch.engine.sequence import Sequence
from mlora.batch.model.attention import AttentionMetadata


@dataclass
class Inputs:
    """One invocation's packed host inputs (row-major lists; ``tables`` per sequence)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]  # each row's KV cache slot (block * block_size + offset)
    starts: list[int]  # query start of each sequence, and the end
    context_lens: list[int]
    tables: list[list[int]]
    sample_rows: list[int]
    adapters: list[str | None]  # each row's adapter (None: base)


@dataclass
class Lookahead:
    """The inputs of the next iteration, built while the device still runs the current
    one, on the guess that it will be "the same decode rows, one more token each".
    ``p0``: each row's position in that iteration (its ``num_computed`` then); token ids
    are read from the rows once they are sampled. ``staged``: the decode graphs' input
    buffers already hold positions, cache slots, context lengths and block tables (copies
    queued behind the current iteration)."""

    seqs: list[Sequence]
    p0: list[int]
    positions: list[int]
    slots_map: list[int]
    ctx: list[int]
    tables: list[list[int]]
    row_adapters: list[str | None]
    staged: bool = False

    def inputs(self) -> Inputs:
        """The iteration's inputs, token ids read from the rows now."""
        n = len(self.seqs)
        ids = [s.tokens[p] for s, p in zip(self.seqs, self.p0)]
        return Inputs(ids, self.positions, self.slots_map, list(range(n + 1)), self.ctx, self.tables,
                      list(range(n)), self.row_adapters)


def run_model(model, kv, bank, x: Inputs, slot_list: list[int] | None) -> torch.Tensor:
    """The model's forward over one invocation's packed inputs (``slot_list``: each row's slot,
    -1 for a base row; None: no adapter in the invocation): logits of the sample rows."""
    dev = model.device
    lora = bank.context(torch.tensor(slot_list, dtype=torch.int32)) if slot_list is not None else None
    meta = AttentionMetadata(
        query_starts=x.starts, context_lens=x.context_lens, block_tables=x.tables,
        slot_mapping=torch.tensor(x.slots, dtype=torch.int64, device=dev),
    )
    return model.forward(
        torch.tensor(x.ids, dtype=torch.int64, device=dev), torch.tensor(x.positions, dtype=torch.int64, device=dev),
        meta, kv, lora, torch.tensor(x.sample_rows, dtype=torch.int64, device=dev),
    )


class Executor:
    """Iterations of ``model`` over the KV cache ``kv`` and the adapters of ``bank``
    (``graphs``: decode graphs, or None; ``chain``: chained decode where it applies; ``tp``: a
    tensor-parallel group's rank 0, ``tpfollow.Leader``, that every forward goes through)."""

    def __init__(self, model, kv, graphs: DecodeGraphs | None, bank, pinned: dict, loads: AdapterLoads, *,
                 sampling: SamplingParams, chain: bool, tp=None):
        self.model, self.kv, self.graphs, self.bank, self.pinned, self.loads = model, kv, graphs, bank, pinned, loads
        self.tp = tp
        self.device = model.device
        self.block_size = kv.block_size
        self.sampling = sampling
        self.chain = chain
        self.ahead: Lookahead | None = None  # the next iteration's inputs, built during this one
        self.inflight: tuple[IterationPlan, torch.Tensor] | None = None  # launched, not yet sampled
        self.lookahead_used = 0  # iterations that ran on inputs built during the one before
        self.chained = 0  # of those, launched before the iteration ahead of them was sampled
        self.iterations = self.prefill_tokens = self.decode_tokens = 0

    def forward(self, plan: IterationPlan, ahead: Lookahead | None = None) -> torch.Tensor:
        """Logits of the plan's sample rows (``ahead``: its inputs, built during the iteration before)."""
        if ahead is not None:
            return self._launch(plan, ahead.inputs(), staged=ahead.staged)
        return self._launch(plan, self._inputs(plan))

    def _inputs(self, plan: IterationPlan) -> Inputs:
        x = Inputs([], [], [], [0], [], [], [], [])
        bs, end = self.block_size, 0
        for seq, n in zip(plan.seqs, plan.new_tokens):
            p0, blocks = seq.num_computed, seq.blocks
            if n == 1:  # a decode row (the steady state: one append per list, no slicing)
                x.ids.append(seq.tokens[p0])
                x.positions.append(p0)
                x.slots.append(blocks[p0 // bs] * bs + p0 % bs)
                x.adapters.append(seq.adapter_at(p0))
            else:
                x.ids += seq.tokens[p0 : p0 + n]
                x.positions += range(p0, p0 + n)
                x.slots += [blocks[p // bs] * bs + p % bs for p in range(p0, p0 + n)]
                # aLoRA: the positions before its activation run on the base (slot -1)
                base = min(max(seq.active_from - p0, 0), n) if seq.adapter is not None else n
                x.adapters += [None] * base + [seq.adapter] * (n - base)
            end += n
            x.starts.append(end)
            x.context_lens.append(p0 + n)
            x.tables.append(blocks)  # read within this invocation only
        for b, s in enumerate(plan.sample):
            if s:
                x.sample_rows.append(x.starts[b + 1] - 1)
        return x

    def count(self, plan: IterationPlan) -> None:
        """The iteration and token counters, for an iteration launched now."""
        self.iterations += 1
        self.prefill_tokens += plan.doff
        self.decode_tokens += plan.num_rows - plan.doff

    def _launch(self, plan: IterationPlan, x: Inputs, staged: bool = False) -> torch.Tensor:
        """Resolve the invocation's adapters to slots (loads, leases) and run the model on the
        packed inputs (a decode graph when the iteration is decode-only and fits one)."""
        slot_list = None
        # every row's adapter has its slot, also an aLoRA row whose positions here all precede its activation
        distinct = sorted({s.adapter for s in plan.seqs if s.adapter is not None})
        if distinct:
            slot_of = self.loads.ensure(distinct)
            for seq in plan.seqs:  # a running row's adapter stays resident between iterations
                if seq.adapter is not None and seq.lease is None:
                    self.bank.acquire(f"row{seq.req.row}", seq.adapter, self.pinned)
                    seq.lease = f"row{seq.req.row}"
            slot_list = [slot_of[a] if a is not None else -1 for a in x.adapters]
        self.count(plan)
        # decode-only (one row per sequence, every row sampled): replay a captured graph
        if self.graphs is not None and plan.doff == 0 and len(x.sample_rows) == len(x.ids) \
                and self.graphs.fits(len(x.ids), max(len(t) for t in x.tables)):
            def replay():
                return self.graphs.run(x.ids, x.positions, x.slots, x.tables, x.context_lens, slot_list, staged=staged)
            if self.tp is not None:  # every rank replays its graph of the same bucket (engine/tpfollow.py)
                return self.tp.replay(x, slot_list, self.graphs.bucket(len(x.ids)), replay)
            return replay()
        if self.tp is not None:  # every rank runs the same invocation (engine/tpfollow.py)
            return self.tp.forward(x, slot_list, lambda: run_model(self.model, self.kv, self.bank, x, slot_list))
        return run_model(self.model, self.kv, self.bank, x, slot_list)

    def build_ahead(self, plan: IterationPlan, p0: list[int]) -> None:
        """The inputs of "every row of ``plan``, one more token each", at positions ``p0`` (the
        rows already hold the blocks: ``Scheduler.grow_ahead``), staged into the decode graphs
        when the iteration fits one; the next step or :meth:`chain_tokens` uses them."""
        bs = self.block_size
        positions, slots_map, ctx, tables, row_adapters = [], [], [], [], []
        for seq, p in zip(plan.seqs, p0):
            positions.append(p)
            slots_map.append(seq.blocks[p // bs] * bs + p % bs)
            ctx.append(p + 1)
            tables.append(seq.blocks)
            row_adapters.append(seq.adapter_at(p))
        ahead = Lookahead(list(plan.seqs), p0, positions, slots_map, ctx, tables, row_adapters)
        if self.graphs is not None and self.graphs.fits(len(plan.seqs), max(len(t) for t in tables)):
            # queued on the compute stream behind this iteration: the graph reads them next time
            self.graphs.stage(positions, slots_map, tables, ctx)
            ahead.staged = True
        self.ahead = ahead

    def tokens(self, sampled: list[Sequence], logits: torch.Tensor) -> list[int]:
        """The tokens of the sample rows (``sampled``: their sequences, in order): chained
        (:meth:`chain_tokens`) where it applies, else sampled from ``logits``."""
        toks = self.chain_tokens(logits) if self.chain and self.ahead is not None else None
        if toks is None:
            toks = sample(logits, self.sampling, [s.key for s in sampled], [s.num_generated for s in sampled])
        return toks

    def chain_tokens(self, logits: torch.Tensor) -> list[int] | None:
        """Launch the looked-ahead iteration (``self.ahead``: this one's rows, one token each)
        now, its token ids this iteration's greedy tokens taken on the device, and return this
        iteration's tokens, read after that launch: the device then runs the next iteration
        while the host appends these tokens, checks stops and finishes rows, instead of
        waiting for the host between iterations. The next step takes the launched iteration as
        its plan (:attr:`inflight`); a row that finishes here was computed there too and its
        token is dropped (its KV write lands in its own freed block, before any later forward
        on the stream can reuse it). The launch skips ``ensure`` and the bank's context: the
        rows, their adapters, leases and slots are the last launch's, and so are the graph's
        LoRA buffers. None (the caller samples as usual) unless the lookahead's inputs are
        staged in the decode graphs and sampling is greedy (the device's argmax is then
        exactly ``sample``'s choice)."""
        ahead = self.ahead
        if not ahead.staged or not self.sampling.greedy:
            return None
        self.ahead = None  # consumed here, not by the next step
        plan = IterationPlan.decode_only(ahead.seqs)
        next_logits, tokens = self.graphs.chain(logits, len(plan.seqs))
        self.inflight = (plan, next_logits)
        self.count(plan)
        self.lookahead_used += 1
        self.chained += 1
        return tokens()

    def take_inflight(self) -> tuple[IterationPlan, torch.Tensor] | None:
        """The iteration the last step launched (chained), unless every row of it finished
        before it (nothing to read then)."""
        inflight, self.inflight = self.inflight, None
        if inflight is not None and not any(s.is_running for s in inflight[0].seqs):
            return None
        return inflight

    def take_ahead(self) -> Lookahead | None:
        ahead, self.ahead = self.ahead, None
        return ahead
