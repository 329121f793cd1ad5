"""The GPU slot bank: resident adapter factors and the per-invocation LoraContext.

Owns the device tensors the segmented kernels read (layout of
``mlora.kernels.add_lora_slices``), which pinned adapter sits in which slot,
load-on-demand with LRU eviction, and the one plan built per model invocation.
Must not know the model's layer code (``mlora.batch.model.lora`` is the seam) nor
read adapter files itself (``catalog.load_factors`` does, verified).
The residency engine's bank (``mlora.batch.adapters.residency.bank``) builds on the
same :class:`SlotTensors` (layout, admission checks, placement) and
:class:`BankContext`; batch-run uses it, and SlotBank stays as its reference.

Per layer and group (``mlora.batch.model.lora.GROUPS``), with S slots, n slices and
physical rank R::

    A       [S, n, R, d_in]         A[s, j, :r]            = lora_A of slice j's module, r = its rank
    B       [S, sum(widths), R]     rank-pitched (``mlora.kernels.pitch``): lora_B of that module is
                                    ``pitched_view(B, s, off_j, w_j, r)``, a [w_j, r] block with row
                                    stride round8(r) from element off_j * R of the slot, so a
                                    low-rank slot in a wide bank reads contiguous rows
    ranks   int32   [n, S]          0 = the slot's adapter does not target slice j
    scales  float32 [n, S]

(the kernels' per-layer views of slot-major tensors: A [S, L, n, R, d_in],
B [S, L, sum(widths), R], ranks and scales [S, L, n]; one slot's entries are
contiguous in each, so a load is one plain copy per tensor).

The slices are the ones the bank holds (``slices``; default all of the group's):
a bank for q/v adapters holds q and v of the q/k/v group and no k slice, so a
slot is no larger than its adapters' factors and a load copies no zeros for
k. Slice j adds into the projection's output at its own columns
(``out_offsets[g][j]``: the k columns are not the bank's and stay untouched).

Writing an adapter zeroes the whole slot first, so every tail (ranks past r, the
padding of rank-pitched B blocks, untargeted slices) is exactly zero (docs/design.md, Logical and
physical rank). Residency is keyed by
``semantic_sha256``, never by id or path: two catalog ids naming the same
adapter share one slot.

The caller (the scheduler) must not ask one ``ensure`` for more distinct
adapters than there are slots (:class:`BankFull`), and must call ``context``
after the ``ensure`` of the same invocation: a later ``ensure`` may evict.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

from mlora.batch.adapters.catalog import PinnedAdapter, load_factors
from mlora.batch.adapters.protocol import BlockingLoads, GraphLora
from mlora.batch.errors import CodedError
from mlora.batch.model.lora import GROUPS, ROLE_SLICE
from mlora.batch.model.tp import TPLayout, bank_shapes, shard_lora
from mlora.kernels import (
    LaunchPlan,
    add_lora_slices,
    build_plan,
    empty_launch_plan,
    lora_silu_mul,
    make_launch_plan,
    pitched_view,
    tile_capacity,
)
from mlora.kernels.launch import DECODE_BLOCK_M

# Invocations of at least this many rows add the gate/up deltas inside the SiLU product
# (BankContext.apply_silu_mul): it pays for prefill-sized batches, not for decode steps.
FUSE_SILU_MIN_ROWS = 1024
# the row-parallel groups of a tensor-parallel bank: shrink, all-reduce of z, expand (BankContext.apply)
ROW_PARALLEL_GROUPS = ("o", "down")


class BankError(CodedError, RuntimeError):
    """The bank cannot place an adapter; ``code`` says why."""


class BankFull(BankError):
    """One call asked for more distinct adapters than the bank has slots."""

    def __init__(self, wanted: int, slots: int):
        super().__init__("E_BANK_FULL", f"{wanted} distinct adapters requested at once, the bank has {slots} slots; "
                         "the scheduler must admit at most that many (raise --max-gpu-adapters or lower --max-num-seqs)")


@dataclass
class BankStats:
    hits: int = 0  # adapter already resident when asked for
    misses: int = 0
    loads: int = 0  # adapters written into a slot
    evictions: int = 0  # resident adapters replaced

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def lru_slot(lru: OrderedDict, num_slots: int, keep, stats: BankStats) -> int:
    """A slot for a newly resident entry of ``lru`` (key -> slot, least recently used first):
    the lowest slot no key holds, else the slot of the least recently used key not in
    ``keep``, which leaves ``lru`` (an eviction, counted in ``stats``). The caller keeps
    ``len(keep) <= num_slots``, so such a key exists when every slot is held."""
    used = set(lru.values())
    free = next((s for s in range(num_slots) if s not in used), None)
    if free is not None:
        return free
    victim = next(k for k in lru if k not in keep)
    stats.evictions += 1
    return lru.pop(victim)


class SlotTensors:
    """Slot tensors for the groups ``groups`` of every layer, in the layout of
    ``mlora.kernels.add_lora_slices``, and the checks that admit a pinned
    adapter's factors into them. Shared by :class:`SlotBank` and the residency
    engine's bank; ``error`` is the exception class each raises."""

    error: type[CodedError] = BankError
    tp = None  # a tensor-parallel rank's bank: its TPShard (SlotBank.for_rank)

    def __init__(self, num_layers: int, shapes: dict[str, tuple[int, tuple[int, ...]]], groups, num_slots: int,
                 max_rank: int, dtype: torch.dtype, device, backend: str = "auto",
                 slices: dict[str, tuple[int, ...]] | None = None, alloc=None):
        """``alloc(shape, dtype)``: where the slot tensors live (a zeroed tensor of that shape with
        the slot axis first; ``arena.SlotCarver`` carves them from one arena's pages); default
        their own allocations on ``device``."""
        if num_slots < 1 or max_rank < 1:
            raise ValueError(f"a slot bank needs num_slots >= 1 and max_rank >= 1, got {num_slots} and {max_rank}")
        device = torch.device(device)
        if backend == "auto":
            backend = "triton" if device.type == "cuda" else "torch"
        if backend not in ("torch", "triton"):
            raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'torch' or 'triton'")
        self.num_layers, self.num_slots, self.max_rank = num_layers, num_slots, max_rank
        self.dtype, self.device, self.backend = dtype, device, backend
        self.groups = tuple(groups)
        held = _held(shapes, self.groups, slices)
        # per group: the held slices' widths, their rows in B (offsets), their first columns in the
        # projection's output (out_offsets), and group slice index -> bank slice index
        self.widths = {g: tuple(int(shapes[g][1][j]) for j in held[g]) for g in self.groups}
        self.d_in = {g: int(shapes[g][0]) for g in self.groups}
        self.offsets = {g: [sum(self.widths[g][:j]) for j in range(len(self.widths[g]))] for g in self.groups}
        self.out_offsets = {g: [sum(int(w) for w in shapes[g][1][:j]) for j in held[g]] for g in self.groups}
        self.slice_index = {g: {j: i for i, j in enumerate(held[g])} for g in self.groups}
        L, S, R = num_layers, num_slots, max_rank
        # One factor tensor per group with a leading slot axis: a slot's factors for every layer are
        # one contiguous block, so a load is one plain host-to-device copy per tensor (a strided
        # slot view made torch stage every copy in a device temporary and scatter it with a
        # kernel, on the busy GPU's SMs). [:, layer] is the kernels' [S, n, R, d_in] / [S, sum(w), R]
        # view (strided over slots; the kernels take the slot stride). Ranks and scales are
        # slot-major too, [S, L, n] (a slot's tables are one plain copy each way: no staging
        # kernel for the load, none for validation's read-back); the kernels get a layer's
        # [n, S] view ``[:, layer].t()`` (``layer_tables``) and take its strides.
        def make(shape, dt):
            return torch.zeros(shape, dtype=dt, device=device) if alloc is None else alloc(shape, dt)

        self.A = {g: make((S, L, len(w), R, self.d_in[g]), dtype) for g, w in self.widths.items()}
        self.B = {g: make((S, L, sum(w), R), dtype) for g, w in self.widths.items()}
        # B is rank-pitched (module docstring): the same bytes as the padded layout when every
        # slot's rank is R; contiguous rows for the low-rank slots of a mixed-rank job
        self.b_layout = "rank-pitched"
        self.ranks = {g: make((S, L, len(w)), torch.int32) for g, w in self.widths.items()}
        self.scales = {g: make((S, L, len(w)), torch.float32) for g, w in self.widths.items()}
        # the fewest rows of an invocation whose gate/up deltas go inside the SiLU product
        self.fuse_silu_min_rows = FUSE_SILU_MIN_ROWS

    def _shard(self, tp: TPShard | None) -> None:
        """Hold ``tp``'s rank's cut of every adapter (no cut at one rank): the row-parallel groups
        add at the rank's ``h/N`` output columns, their bottleneck summed over the group (BankContext)."""
        self.tp = tp if tp is not None and tp.layout.size > 1 else None
        if self.tp is not None:
            for g, start in bank_shapes(tp.config, tp.layout)[1].items():
                if g in self.out_offsets:
                    self.out_offsets[g] = [start]

    def layer_tables(self, group: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernels' ``[n, S]`` ranks and scales of one (group, layer): views, no copy."""
        return self.ranks[group][:, layer].t(), self.scales[group][:, layer].t()

    @staticmethod
    def bytes_per_slot(num_layers: int, shapes: dict[str, tuple[int, tuple[int, ...]]], max_rank: int,
                       dtype: torch.dtype, slices: dict[str, tuple[int, ...]] | None = None) -> int:
        """Device bytes one slot costs (factors at physical rank plus rank/scale entries) for the
        groups of ``shapes``, holding ``slices`` of each (default all)."""
        elem = torch.empty((), dtype=dtype).element_size()
        held = _held(shapes, tuple(shapes), slices)
        per_layer = 0
        for g, (d_in, widths) in shapes.items():
            w = [int(widths[j]) for j in held[g]]
            per_layer += len(w) * max_rank * d_in * elem + sum(w) * max_rank * elem + len(w) * 8
        return num_layers * per_layer

    def _plans(self, row_slots: torch.Tensor, static: LaunchPlan | None = None):
        """(row slots on the device, SegmentPlan on the host, the plan the kernels
        read) of one invocation. The SegmentPlan is built on the host from the
        scheduler's row slots, so nothing waits for the device; the kernels get a
        LaunchPlan on the device (copied into ``static``, a captured CUDA graph's
        buffers, when given) or, for the torch backend, the SegmentPlan there."""
        if row_slots.dim() != 1:
            raise ValueError(f"row_slots must be 1-D, got shape {tuple(row_slots.shape)}")
        host = row_slots.to("cpu", torch.int32)
        if host.numel() and int(host.min()) < -1:
            raise self.error("E_BANK_SLOT_EMPTY", "row_slots hold values below -1 (-1 = base only)")
        if static is not None and self.backend == "triton":
            # refilled only when the row slots differ from its last fill (LaunchPlan.fill_from_rows)
            return host.to(self.device), static.fill_from_rows(host), static
        plan = build_plan(host)
        if self.backend != "triton":
            return host.to(self.device), plan, plan.to(self.device)
        kernel = make_launch_plan(plan).to(self.device) if plan.num_segments else plan.to(self.device)
        return host.to(self.device), plan, kernel

    def graph_lora(self, rows: int) -> GraphLora:
        """The LoRA context a decode graph of ``rows`` rows is captured with: every group the
        bank holds slots for (rank-0 slices leave their columns untouched), over a static
        launch plan that ``context(row_slots, static=plan)`` refills before each replay."""
        everything = frozenset((layer, g) for layer in range(self.num_layers) for g in self.groups)
        plan = empty_launch_plan(rows, tile_capacity(rows, self.num_slots, DECODE_BLOCK_M), DECODE_BLOCK_M, self.device)
        row_slots = torch.full((rows,), -1, dtype=torch.int32, device=self.device)
        return GraphLora(BankContext(self, row_slots, plan, everything), plan)

    def _check(self, adapter_id: str, pinned: dict[str, PinnedAdapter]) -> PinnedAdapter:
        """The pinned record of a servable adapter whose rank fits the slots."""
        p = pinned.get(adapter_id)
        if p is None:
            raise self.error("E_ADAPTER_UNKNOWN", f"adapter {adapter_id!r} was not pinned at job start")
        if not p.ok:
            raise self.error(p.error_code or "E_ADAPTER_INVALID", f"adapter {adapter_id!r} is not servable: "
                             f"{p.error_message}")
        if p.max_rank > self.max_rank:
            raise self.error("E_BANK_RANK_EXCEEDS_R", f"adapter {adapter_id!r} has rank {p.max_rank}, the bank's "
                             f"slots hold rank {self.max_rank}; size the bank for the job's largest rank")
        return p

    def _place(self, p: PinnedAdapter, factors) -> list[tuple]:
        """(layer, group, slice, A, B, rank, scale) of every ``((layer, role), (A, B, scale))``
        in ``factors``, each checked against the slots."""
        placed = []
        for (layer, role), (a, b, scale) in factors:
            group, j = ROLE_SLICE[role]
            if group not in self.widths or j not in self.slice_index[group]:
                raise self.error("E_BANK_SHAPE", f"adapter {p.id!r} targets {role}, the bank holds no {role} slots "
                                 "(it was sized for the modules the job's adapters target at start)")
            j = self.slice_index[group][j]
            r, w = a.shape[0], self.widths[group][j]
            if not 0 <= layer < self.num_layers or a.shape != (r, self.d_in[group]) or b.shape != (w, r):
                raise self.error("E_BANK_SHAPE", f"adapter {p.id!r} {role} of layer {layer}: A {list(a.shape)}, "
                                 f"B {list(b.shape)} do not fit the model ({self.num_layers} layers, d_in "
                                 f"{self.d_in[group]}, width {w})")
            if r > self.max_rank:
                raise self.error("E_BANK_RANK_EXCEEDS_R", f"adapter {p.id!r} {role} has rank {r} > {self.max_rank}")
            placed.append((layer, group, j, a, b, r, scale))
        return placed


def _held(shapes: dict, groups, slices: dict[str, tuple[int, ...]] | None) -> dict[str, tuple[int, ...]]:
    """group -> the sorted slice indices a bank holds (all of each group's without ``slices``)."""
    held = {}
    for g in groups:
        n = len(shapes[g][1])
        js = tuple(range(n)) if slices is None or g not in slices else tuple(sorted(set(int(j) for j in slices[g])))
        if not js or not all(0 <= j < n for j in js):
            raise ValueError(f"slices of {g} must be a non-empty subset of range({n}), got {slices.get(g)}")
        held[g] = js
    return held


def rank_cut(factors, config, layout: TPLayout) -> list:
    """``((layer, role), (A, B, scale))`` of one tensor-parallel rank's cut of an adapter's
    ``factors`` (``tp.shard_lora``: views), the cut every bank of that rank holds."""
    return [((layer, role), (*shard_lora(role, a, b, config, layout), scale)) for (layer, role), (a, b, scale) in factors]


class TPShard(NamedTuple):
    """A tensor-parallel rank's bank: the whole base's ``config``, the rank's ``layout`` and its
    group's ``collective`` (``all_reduce``), for a bank that holds the rank's cut of every adapter."""

    config: object
    layout: TPLayout
    collective: object


class SlotBank(SlotTensors, BlockingLoads):
    """``num_slots`` adapter slots for every (layer, group) of a decoder, loaded inside ``ensure``.

    With ``tp`` (:meth:`for_rank`) the slots hold one tensor-parallel rank's cut of every adapter
    (docs/scaleout.md, "Tensor parallelism: how adapters are placed"): q/k/v and gate/up on the
    rank's output widths with the segmented kernels, o and down as the same kernels' shrink,
    all-reduce of the rank-width partial between the two launches, expand into the rank's
    ``h/N`` output columns (:class:`BankContext`)."""

    def __init__(self, num_layers: int, shapes: dict[str, tuple[int, tuple[int, ...]]], num_slots: int,
                 max_rank: int, dtype: torch.dtype, device, backend: str = "auto", tp: TPShard | None = None,
                 alloc=None):
        """``alloc``: where the slot tensors live (``SlotTensors``; an ``arena.SlotCarver`` carves
        them from a joint ledger's arena)."""
        if set(shapes) != set(GROUPS):
            raise ValueError(f"shapes must describe the groups {sorted(GROUPS)}, got {sorted(shapes)}")
        super().__init__(num_layers, shapes, GROUPS, num_slots, max_rank, dtype, device, backend, alloc=alloc)
        self._shard(tp)
        self.stats = BankStats()
        self._lru: OrderedDict[str, int] = OrderedDict()  # semantic_sha256 -> slot, least recent first
        self._targets: list[frozenset[tuple[int, str]]] = [frozenset()] * num_slots  # (layer, group) each slot adapts
        # a tensor-parallel follower's host images of its cuts (``cutcache.CutCache`` over
        # ``host_cut``): ``load_into`` copies from them instead of reading the adapter again
        self.images = None

    @classmethod
    def for_rank(cls, tp: TPShard, num_slots: int, max_rank: int, dtype: torch.dtype, device,
                 backend: str = "auto", alloc=None) -> SlotBank:
        """The bank of one tensor-parallel rank: slots at the shapes of the rank's cut (``tp.bank_shapes``)."""
        return cls(tp.config.num_layers, bank_shapes(tp.config, tp.layout)[0], num_slots, max_rank, dtype, device,
                   backend, tp, alloc)

    @property
    def resident(self) -> dict[str, int]:
        """semantic_sha256 -> slot of every resident adapter, least recently used first."""
        return dict(self._lru)

    def ensure(self, adapter_ids: list[str], pinned: dict[str, PinnedAdapter]) -> dict[str, int]:
        """Make every listed adapter resident and return adapter id -> slot.

        Misses are loaded (verified, ``catalog.load_factors``) into a free slot
        or the least recently used slot that this call does not need. Raises
        BankFull for more distinct adapters than slots, BankError for an
        unknown or unservable id or a rank above the bank's, AdapterChanged
        when an adapter's bytes changed; the bank is unchanged for the
        adapter that failed (it is loaded before anything is evicted)."""
        wanted: OrderedDict[str, PinnedAdapter] = OrderedDict()
        for adapter_id in adapter_ids:
            p = self._check(adapter_id, pinned)
            wanted.setdefault(p.semantic_sha256, p)
        if len(wanted) > self.num_slots:
            raise BankFull(len(wanted), self.num_slots)
        for key, p in wanted.items():
            if key in self._lru:
                self.stats.hits += 1
                self._lru.move_to_end(key)
                continue
            self.stats.misses += 1
            self._load(key, p, wanted)
            self.stats.loads += 1
        return {i: self._lru[pinned[i].semantic_sha256] for i in adapter_ids}

    def _load(self, key: str, p: PinnedAdapter, keep) -> None:
        """Read, check and write one missing adapter into a free or least recently used slot
        that ``keep`` does not hold (read before anything is evicted)."""
        placed = self._place(p, self._factors(p))
        slot = lru_slot(self._lru, self.num_slots, keep, self.stats)
        self._write(slot, placed)
        self._lru[key] = slot

    def load_into(self, slot: int, p: PinnedAdapter) -> None:
        """Write ``p`` into ``slot``, whatever it held (a tensor-parallel follower: rank 0's bank
        chose the slot), from ``images`` when the bank has them, else read from disk; the slot is
        emptied first, so a failed read leaves it empty."""
        for key in [k for k, s in self._lru.items() if s == slot]:
            del self._lru[key]
        image = self.images.get(p) if self.images is not None else None  # held until written (its pinned block)
        self._write(slot, image.placed if image is not None else self._place(p, self._factors(p)))
        self._lru[p.semantic_sha256] = slot

    def host_cut(self, p: PinnedAdapter) -> list[tuple]:
        """The placed rows (``_place``) of ``p``'s verified factors on the host, the rank's cut
        under TP (views of the whole factors): what ``images`` builds an image from."""
        return self._place(p, self._factors(p, "cpu"))

    def image_bytes(self) -> int:
        """An upper bound on the bytes of one adapter's placed A and B (each 64-byte aligned)."""
        pieces = sum(2 * self.num_layers * len(w) for w in self.widths.values())
        return sum(t[0].numel() * t.element_size() for t in (*self.A.values(), *self.B.values())) + 64 * pieces

    def _factors(self, p: PinnedAdapter, device=None):
        """``((layer, role), (A, B, scale))`` of the adapter's verified factors (on ``device``,
        default the bank's), the rank's cut under TP."""
        factors = load_factors(p, self.dtype, self.device if device is None else device).items()
        return factors if self.tp is None else rank_cut(factors, self.tp.config, self.tp.layout)

    def _write(self, slot: int, placed: list[tuple]) -> None:
        for g in GROUPS:
            self.A[g][slot].zero_()
            self.B[g][slot].zero_()
            self.ranks[g][slot] = 0
            self.scales[g][slot] = 0.0
        for layer, group, j, a, b, r, scale in placed:
            off = self.offsets[group][j]
            self.A[group][slot, layer, j, :r].copy_(a)
            pitched_view(self.B[group][:, layer], slot, off, b.shape[0], r).copy_(b)
            self.ranks[group][slot, layer, j] = r
            self.scales[group][slot, layer, j] = scale
        self._targets[slot] = frozenset((layer, group) for layer, group, *_ in placed)

    def context(self, row_slots: torch.Tensor, static: LaunchPlan | None = None) -> "BankContext":
        """The LoraContext of one model invocation: one plan, shared by every layer.
        ``row_slots`` [T] gives each packed row's slot (-1 = base only); every
        slot named must hold an adapter (a row never silently runs the base).
        ``static``: the LaunchPlan buffers of a captured CUDA graph to fill."""
        row_slots, plan, kernel_plan = self._plans(row_slots, static)
        active = plan.slot_ids.tolist()
        occupied = set(self._lru.values())
        stray = [s for s in active if s not in occupied]
        if stray:
            raise BankError("E_BANK_SLOT_EMPTY", f"row_slots name slots {stray} that hold no adapter; "
                            "call ensure() for this invocation's adapters first")
        targeted = frozenset().union(*(self._targets[s] for s in active))
        return BankContext(self, row_slots, kernel_plan, targeted)


class BankContext:
    """``mlora.batch.model.lora.LoraContext`` over a SlotBank for one invocation."""

    def __init__(self, bank: SlotBank, row_slots: torch.Tensor, plan, targeted: frozenset[tuple[int, str]]):
        self.bank, self.row_slots, self.plan, self.targeted = bank, row_slots, plan, targeted

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the LoRA deltas of this invocation's rows to ``y`` in place.

        o and down on a tensor-parallel rank hold the rank's input columns of A: the kernels'
        bottleneck ``z = x A_s^T`` is that rank's partial, summed over the group between the
        shrink and the expand (``reduce_z``; every rank makes the same calls with the same
        plan), then ``y[:, o:o+w] += scale_s * z B_s^T`` with the rank's ``h/N`` rows of B at
        its columns (docs/scaleout.md, "Tensor parallelism: how adapters are placed")."""
        if (layer, group) not in self.targeted:  # no active slot adapts this module: nothing to add
            return
        bank = self.bank
        reduce_z = bank.tp.collective.all_reduce if bank.tp is not None and group in ROW_PARALLEL_GROUPS else None
        ranks, scales = bank.layer_tables(group, layer)
        add_lora_slices(
            y, x, bank.A[group][:, layer], bank.B[group][:, layer], self.row_slots, widths=bank.widths[group],
            ranks=ranks, scales=scales, backend=bank.backend,
            plan=self.plan, check_values=False,  # ranks checked when written, row slots in context()
            out_offsets=bank.out_offsets[group], b_layout=bank.b_layout, reduce_z=reduce_z,
        )

    def apply_silu_mul(self, layer: int, x: torch.Tensor, gate_up: torch.Tensor, inter: int, ops) -> torch.Tensor:
        """``ops.silu_mul`` of ``gate_up`` plus this invocation's gate/up deltas. With the
        Triton kernels (a Triton bank, an invocation of at least ``fuse_silu_min_rows`` rows,
        the fused element-wise ops, both slices held side by side) one launch after the shrink
        adds the deltas inside the SiLU product (``mlora.kernels.lora_silu_mul``) and
        ``gate_up`` keeps the base values; otherwise :meth:`apply`, then ``ops.silu_mul``.
        Large batches only (prefill chunks, mixed iterations): at decode sizes the two
        launches are faster."""
        group = "gate_up"
        bank = self.bank
        if ((layer, group) in self.targeted and bank.backend == "triton" and getattr(ops, "fused", False)
                and isinstance(self.plan, LaunchPlan) and self.row_slots.shape[0] >= bank.fuse_silu_min_rows
                and tuple(bank.widths.get(group, ())) == (inter, inter) and list(bank.out_offsets[group]) == [0, inter]):
            ranks, scales = bank.layer_tables(group, layer)
            return lora_silu_mul(gate_up, x, bank.A[group][:, layer], bank.B[group][:, layer], self.row_slots,
                                 inter=inter, ranks=ranks, scales=scales, backend="triton", plan=self.plan,
                                 check_values=False, b_layout=bank.b_layout)
        self.apply(layer, group, x, gate_up)
        return ops.silu_mul(gate_up, inter)
