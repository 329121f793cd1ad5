"""CUDA graphs of the decode step (docs/design.md, Decode graphs).

Owns the static device buffers a captured decode step reads, one CUDA graph
per batch-size bucket, and the per-iteration refill of those buffers. Must not
schedule, sample or touch the block allocator: the engine hands it one
decode-only iteration (every sequence one new row, every row sampled) as host
lists and gets logits (the model's dtype) back.

A decode iteration of ``b`` sequences runs the graph of the smallest bucket
``>= b``. Rows ``b .. bucket-1`` are padding: token 0 at position 0, context
length 0 (the attention kernel reads no keys for them), their K/V written to
a scratch block no sequence owns, slot -1 for LoRA; their logits are dropped.
Every replay first copies the iteration's inputs into the static buffers
(token ids, positions, cache slots, block tables, context lengths, LoRA row
slots and tile list), all stream-ordered, no host sync. Each bucket's LoRA
context and static buffers come from the bank (``graph_lora``: a static launch
plan for slot banks, a static row buffer for the bundle bank); before each
replay the bank refills them from the host (``context(row_slots, static=...)``),
doing its residency bookkeeping exactly as for an eager invocation.

Semantics are those of the eager forward; the numbers can differ in the last
bits because padded batch sizes may pick different GEMM kernels.

On a device without CUDA graphs (the CPU: tests in CI) capture and replay are
emulated: the same static buffers, buckets, padding, staging and tile lists,
with the captured forward re-run eagerly at each replay into the bucket's
static logits (the Triton kernels interpreted), and every warm-up and replay
first checks the buffers' invariants (:meth:`DecodeGraphs.check_buffers`), so
the buffer protocol is tested on the CPU too.
"""

from __future__ import annotations

import os

import torch

from mlora.batch.model.attention import AttentionMetadata
from mlora.kernels import LaunchPlan
from mlora.kernels.greedy import greedy_tokens
from mlora.kernels.launch import DECODE_BLOCK_M
from mlora.kernels.paged_attention import PagedLayout, TileList, decode_block_q, longest_first, pad_tables

BLOCK_M = DECODE_BLOCK_M  # LoRA row tile of decode batches (the slot banks' graph launch plans)


class GraphBufferError(AssertionError):
    """A static buffer of the decode graphs breaks an invariant a replay relies on (a bug)."""


class _EmulatedGraph:
    """Stands in for a captured CUDA graph where there are none: ``replay`` re-runs the
    captured forward (over the same static buffers) into the bucket's static logits."""

    def __init__(self, forward, logits: torch.Tensor):
        self.forward, self.logits = forward, logits

    def replay(self) -> None:
        self.logits.copy_(self.forward())


def buckets_for(max_seqs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, 16, then steps of 16 to 64, of 32 beyond, and ``max_seqs``."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_seqs]
    sizes += list(range(16, min(max_seqs, 64) + 1, 16)) + list(range(96, max_seqs + 1, 32))
    return sorted(set(s for s in sizes if s <= max_seqs) | {max_seqs})


class DecodeGraphs:
    """Decode-step graphs over ``model``, its KV cache ``kv`` and slot ``bank`` (or None)."""

    def __init__(self, model, kv, bank, max_seqs: int, scratch_slot: int):
        self.model, self.kv, self.bank = model, kv, bank
        self.device = model.device
        self.emulated = self.device.type != "cuda"  # module docstring: replay re-runs the forward
        # the buffers' invariants checked before every warm-up and replay: always when emulated,
        # on a GPU with MLORA_DEBUG_GRAPHS=1 (a host sync per replay: debugging only)
        self.checked = self.emulated or os.environ.get("MLORA_DEBUG_GRAPHS") == "1"
        self.buckets = buckets_for(max_seqs)
        self.max_seqs = max_seqs
        self.scratch_slot = scratch_slot
        self.width = -(-model.config.max_position_embeddings // kv.block_size)
        B, dev = max_seqs, self.device
        i64, i32 = dict(dtype=torch.int64, device=dev), dict(dtype=torch.int32, device=dev)
        self.ids = torch.zeros(B, **i64)
        self.positions = torch.zeros(B, **i64)
        self.slot_mapping = torch.full((B,), scratch_slot, **i64)
        self.sample_rows = torch.arange(B, **i64)
        self.block_tables = torch.zeros(B, self.width, **i32)
        self.context_lens = torch.zeros(B, **i32)
        self.query_starts = torch.arange(B + 1, **i32)
        self.tile_seq = torch.arange(B, **i32)  # a permutation of the bucket's rows (longest_first)
        self.tile_q0 = torch.zeros(B, **i32)
        group = model.config.num_heads // model.config.num_kv_heads
        self.group = group
        self.block_q = decode_block_q(group)
        # per bucket: the LoRA context its graph is captured with and the static buffers the
        # bank's context refills before each replay (a launch plan, or a row buffer)
        self.lora = {b: bank.graph_lora(b) for b in self.buckets} if bank is not None else {}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.replays = 0
        # pinned host buffers of stage(), two sets used in turn: a set is refilled only after
        # the copies out of it (two stages ago) completed, so no copy reads a half-written set
        self._staging: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = []
        self._turn = 0
        self._tok_host: torch.Tensor | None = None  # chain(): the last iteration's tokens, read by the host

    def fits(self, num_seqs: int, max_blocks: int) -> bool:
        return 1 <= num_seqs <= self.max_seqs and max_blocks <= self.width

    def capture_all(self) -> None:
        """Capture every bucket not captured yet, now (benchmarks: no capture inside a timed
        run; a job captures each bucket the first time a batch of its size runs)."""
        for b in self.buckets:
            if b not in self.graphs:
                self._pad(0, b)
                self._capture(b)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _meta(self, b: int) -> AttentionMetadata:
        meta = AttentionMetadata(query_starts=list(range(b + 1)), context_lens=[0] * b, block_tables=[[]] * b,
                                 slot_mapping=self.slot_mapping[:b], backend="triton")
        layout = PagedLayout(self.block_tables[:b], self.context_lens[:b], self.query_starts[:b + 1],
                             [TileList(self.block_q, self.tile_seq[:b], self.tile_q0[:b], decode=True,
                                       heads_first=True)])
        meta._views[("paged", self.kv.block_size, self.group, str(self.device))] = layout
        return meta

    def _capture(self, b: int) -> None:
        """Capture bucket ``b`` while its buffers hold padding (the warm-up run writes only the scratch slot).
        The decode tiles are reset to the bucket's own rows first: a larger bucket's order left in
        ``tile_seq`` names rows past ``b``, and the eager warm-up run would read and write query
        and output rows outside this bucket's tensors (an illegal memory access on a GPU; the
        run after the capture writes the batch's own order)."""
        self.tile_seq[:b].copy_(torch.arange(b, dtype=torch.int32), non_blocking=True)
        meta = self._meta(b)
        lora = self.lora[b].context if b in self.lora else None
        args = (self.ids[:b], self.positions[:b], meta, self.kv, lora, self.sample_rows[:b])
        if self.checked:
            self.check_buffers(b, 0)
        if self.emulated:  # nothing to compile or capture: one eager run gives the static output
            logits = self.model.forward(*args).clone()
            self.graphs[b] = (_EmulatedGraph(lambda: self.model.forward(*args), logits), logits)
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.model.forward(*args)  # compiles and autotunes outside the capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the prefetch thread may pin host memory while this thread captures
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self.model.forward(*args)
        self.pool = graph.pool()
        self.graphs[b] = (graph, logits)

    def stage(self, positions: list[int], slots: list[int], tables: list[list[int]], context_lens: list[int]) -> None:
        """Queue the copies of a coming decode iteration's positions, cache slots, block tables
        and context lengths into the static buffers, behind the work already on the stream (the
        iteration that still reads them), from pinned memory: the host does not wait. The
        next :meth:`run` with ``staged=True`` copies only the token ids and the LoRA rows."""
        n, nb = len(positions), max(len(t) for t in tables)
        if not self._staging:
            pin = dict(pin_memory=not self.emulated)
            self._staging = [(torch.zeros(2, self.max_seqs, dtype=torch.int64, **pin),
                              torch.zeros(2, self.max_seqs, dtype=torch.int32, **pin),
                              torch.zeros(self.max_seqs * self.width, dtype=torch.int32, **pin), None)
                             for _ in range(2)]
        i64, ctx, tab, done = self._staging[self._turn]
        if done is not None:
            done.synchronize()  # its copies were queued two stages ago: long finished
        i64[0, :n] = torch.tensor(positions, dtype=torch.int64)
        i64[1, :n] = torch.tensor(slots, dtype=torch.int64)
        ctx[0, :n] = torch.tensor(context_lens, dtype=torch.int32)
        b = self.bucket(n)  # the decode tiles' order (int32, as tile_seq) in the second row
        ctx[1, :b] = self._tile_order(context_lens, b)
        self.tile_seq[:b].copy_(ctx[1, :b], non_blocking=True)
        table = tab[:n * nb].view(n, nb)  # contiguous: a strided pinned source would be staged through pageable memory
        table.copy_(torch.from_numpy(pad_tables(tables, nb)))
        self.positions[:n].copy_(i64[0, :n], non_blocking=True)
        self.slot_mapping[:n].copy_(i64[1, :n], non_blocking=True)
        self.context_lens[:n].copy_(ctx[0, :n], non_blocking=True)
        self.block_tables[:n, :nb].copy_(table, non_blocking=True)
        event = None
        if not self.emulated:
            event = torch.cuda.Event()
            event.record()
        self._staging[self._turn] = (i64, ctx, tab, event)
        self._turn ^= 1

    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            context_lens: list[int], row_slots: list[int] | None, staged: bool = False) -> torch.Tensor:
        """Logits [len(ids), vocab] (the model's dtype) of one decode iteration; valid until the next call.
        ``staged``: :meth:`stage` already queued this iteration's positions, slots, tables and
        context lengths (the same lists)."""
        n = len(ids)
        b = self.bucket(n)
        if b not in self.graphs:
            self._pad(0, b)  # overwrites whatever was staged: copy everything below
            self._capture(b)
            staged = False
        self._pad(n, b)
        if staged:
            self.ids[:n].copy_(torch.tensor(ids, dtype=torch.int64), non_blocking=True)
        else:
            nb = max(len(t) for t in tables)
            host = torch.tensor([ids, positions, slots], dtype=torch.int64)
            self.ids[:n].copy_(host[0], non_blocking=True)
            self.positions[:n].copy_(host[1], non_blocking=True)
            self.slot_mapping[:n].copy_(host[2], non_blocking=True)
            self.context_lens[:n].copy_(torch.tensor(context_lens, dtype=torch.int32), non_blocking=True)
            self.block_tables[:n, :nb].copy_(torch.from_numpy(pad_tables(tables, nb)), non_blocking=True)
            self.tile_seq[:b].copy_(self._tile_order(context_lens, b), non_blocking=True)
        if self.bank is not None:
            padded = (row_slots or [-1] * n) + [-1] * (b - n)
            self.bank.context(torch.tensor(padded, dtype=torch.int32), static=self.lora[b].static)
        return self._replay(b, n)

    def _replay(self, b: int, n: int) -> torch.Tensor:
        """Replay bucket ``b``'s graph over buffers holding ``n`` real rows (checked first where
        ``checked``); its logits' first ``n`` rows."""
        graph, logits = self.graphs[b]
        if self.checked:
            self.check_buffers(b, n)
        graph.replay()
        self.replays += 1
        return logits[:n]

    def chain(self, logits: torch.Tensor, n: int):
        """Launch the next decode iteration of the same ``n`` rows as the last replay (its
        inputs staged already), with the greedy tokens of ``logits`` (the last iteration's,
        ``[n, vocab]``, still in its bucket's static buffer) as its token ids, written into the
        graphs' token-id buffer on the device. Returns (the new iteration's logits, valid until
        the next call; a function that waits for the last iteration's tokens alone and returns
        them as a list). The argmax and its copy to the host are queued before the replay,
        which overwrites ``logits``. The LoRA buffers are not refilled: they hold the last
        replay's rows, which are these (the bank's context would also copy the row slots to
        the device, a copy that waits for the stream, i.e. for the running iteration)."""
        b = self.bucket(n)
        # torch.argmax's choice (two launches on CUDA: mlora.kernels.greedy), written straight into the
        # token-id buffer the next replay reads (the last replay, the only reader, is done by then)
        tok = greedy_tokens(logits, out=self.ids[:n])
        if self._tok_host is None:
            self._tok_host = torch.zeros(self.max_seqs, dtype=torch.int64, pin_memory=not self.emulated)
        host = self._tok_host[:n]
        host.copy_(tok, non_blocking=True)
        event = None
        if not self.emulated:
            event = torch.cuda.Event()
            event.record()
        self._pad(n, b)
        out = self._replay(b, n)

        def tokens() -> list[int]:
            if event is not None:
                event.synchronize()
            return host.tolist()

        return out, tokens

    @staticmethod
    def _tile_order(context_lens: list[int], b: int) -> torch.Tensor:
        """The decode tiles of a ``b``-row bucket whose first ``len(context_lens)`` rows are real:
        real rows longest context first (ties in batch order), then the padding rows. Always a
        permutation of the whole bucket, whatever the previous iteration's row count was."""
        n = len(context_lens)
        order = longest_first(range(n), context_lens) + list(range(n, b))
        return torch.tensor(order, dtype=torch.int32)

    def check_buffers(self, b: int, n: int) -> None:
        """The invariants a replay of bucket ``b`` with ``n`` real rows relies on, read back from
        the static buffers (a host sync: emulated graphs, tests and ``MLORA_DEBUG_GRAPHS=1``); raises
        ``GraphBufferError`` naming the first one broken. The decode tiles are a permutation of
        the bucket's rows (a row past ``b`` is read and written outside the bucket's tensors);
        padding rows are padding (token 0, position 0, the scratch cache slot, no context); the
        real rows' contexts fit their block tables and name only blocks of the cache; the LoRA
        tile list (slot banks) holds at most its capacity of tiles, each over rows of the bucket."""
        order = self.tile_seq[:b].tolist()
        if sorted(order) != list(range(b)):
            raise GraphBufferError(f"bucket {b}: decode tiles {order} are not a permutation of rows 0..{b - 1}")
        pad = slice(n, b)
        if (self.ids[pad].any() or self.positions[pad].any() or self.context_lens[pad].any()
                or bool((self.slot_mapping[pad] != self.scratch_slot).any())):
            raise GraphBufferError(f"bucket {b}: padding rows {n}..{b - 1} are not padding")
        ctx = self.context_lens[:n]
        blocks = -(-ctx // self.kv.block_size)
        if bool((ctx < 1).any()) or bool((blocks > self.width).any()):
            raise GraphBufferError(f"bucket {b}: context lengths {ctx.tolist()} outside 1..{self.width * self.kv.block_size}")
        used = torch.arange(self.width, device=ctx.device)[None, :] < blocks[:, None]
        tables = self.block_tables[:n]
        if bool(((tables < 0) | (tables >= self.kv.num_blocks))[used].any()):
            raise GraphBufferError(f"bucket {b}: a block table names a block outside the cache's {self.kv.num_blocks}")
        lp = self.lora[b].static if b in self.lora else None
        if isinstance(lp, LaunchPlan):  # the LoRA tile list
            k = int(lp.num_tiles)
            if k > lp.tile_capacity:
                raise GraphBufferError(f"bucket {b}: {k} LoRA tiles in a list of {lp.tile_capacity}")
            start, end = lp.tile_start[:k].long(), lp.tile_end[:k].long()
            if bool(((start < 0) | (end > lp.row_capacity) | (start >= end)).any()):
                raise GraphBufferError(f"bucket {b}: a LoRA tile's grouped rows lie outside 0..{lp.row_capacity}")
            u = (start[:, None] + torch.arange(lp.block_m, device=start.device)[None, :])
            rows = lp.sorted_rows[u.clamp(max=lp.row_capacity - 1)][u < end[:, None]]
            if bool(((rows < 0) | (rows >= b)).any()):
                raise GraphBufferError(f"bucket {b}: a LoRA tile names a row outside the bucket's {b}")

    def _pad(self, start: int, end: int) -> None:
        """Rows ``start .. end-1`` become padding."""
        if start < end:
            self.ids[start:end].zero_()
            self.positions[start:end].zero_()
            self.slot_mapping[start:end].fill_(self.scratch_slot)
            self.context_lens[start:end].zero_()
