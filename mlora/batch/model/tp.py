"""The tensor-parallel layout contract: which part of every base weight and LoRA factor a rank holds.

Owns ``TPLayout`` (rank ``j`` of ``N``), a rank's local ``ModelConfig`` (``shard_config``), the cut
of every base weight (``weight_cuts``) and LoRA factor (``lora_cuts``, ``shard_lora``), the
per-rank adapter residency (``lora_elements``) and the reference math of the sharded LoRA, with the
collectives as plain Python over per-rank lists (``column_parallel_delta``,
``row_parallel_output``). Pure: it starts no process and calls no collective
(``mlora.batch.model.tpgroup`` does); docs/scaleout.md, "Tensor parallelism: how adapters are placed".

Base weights (rank j of N; embeddings, ``lm_head``, norms and the o bias are whole on every rank)::

    q_proj           rows    heads [j H/N, (j+1) H/N)                        column-parallel
    k_proj, v_proj   rows    the kv heads those q heads read: H_kv/N of them,
                             or the one they share when N > H_kv (replicated)
    gate_proj, up_proj  rows  intermediate [j I/N, (j+1) I/N), cut separately, then fused
    o_proj           columns  the rank's q heads                             row-parallel
    down_proj        columns  the rank's intermediate slice                  row-parallel

A row-parallel projection gives each rank a partial sum of the whole output; the model sums the
partials over the group (one all-reduce after o, one after down) and adds the o bias once, after
the sum.

LoRA factors, in checkpoint orientation A [r, d_in], B [d_out, r] (delta = x A^T B^T)::

    column-parallel (q, k, v, gate, up)   A whole on every rank     B rows = the base's rows
        rank j:  D_j = (x A^T) B_j^T, the rank's output columns; no collective
    row-parallel (o, down)                A columns = the base's    B rows [j h/N, (j+1) h/N)
        rank j:  P_j = x_j A_j^T [T, r];  Z = sum_j P_j (all-reduce);  D_j = Z B_j^T [T, h/N]
                 added into columns [j h/N, (j+1) h/N) of the rank's base partial before the
                 base all-reduce, which sums the base partials and gathers the disjoint slices

Why A is whole on column-parallel ranks, not cut on the rank axis and all-gathered (the paper's
schedule, kept as ``column_parallel_delta``'s default ``gather`` for the trace): Llama-3-8B
(h 4096, I 14336, 32 layers, 32 heads, 8 kv heads, head_dim 128), rank 16, bf16, all seven
modules, per token row of a forward:

- Residency. One adapter is 41,943,040 elements (80 MiB); its column-parallel A factors are
  10,485,760 of them (20 MiB). Cut everywhere: 80/N MiB per rank (N=2: 40, N=8: 10). A whole:
  20 + 60/N MiB per rank (N=2: 50, N=8: 27.5), i.e. 10 and 17.5 MiB more per adapter per rank.
- Communication (ring ledger, elements per rank). The cut A needs one all-gather of the
  bottleneck per column-parallel group: 5(N-1)r/N per layer (N=2: 40, N=8: 70; 1,280 and 2,240
  per forward), under 1% of the base's two [T, h] all-reduces (4(N-1)h/N per layer: 8,192 and
  14,336), but two more collective calls per layer (64 per forward with q/k/v and gate/up gathered
  together, 160 one module at a time) beside the 64 of the base and the 64 rank-width
  all-reduces of o and down that both choices make. At decode a collective costs its start-up
  latency, not its bytes, so the cut A adds half again to the per-token collective count.
- Compute. A whole repeats the shrink on every rank: 5 r h multiply-adds per token per layer,
  N x 0.23% of the rank's column-parallel base GEMMs (N=2: 0.46%, N=8: 1.8%).
- Ranks. A whole needs no rule tying the adapter rank to N: mixed ranks and r < N serve as on
  one device, with the same segment plan and shrink kernel.

So mlora keeps A whole on column-parallel ranks: no collective, the latency that matters, for 10
to 17.5 MiB per adapter per rank, which an H200 holding a 1/N share of the base can spare.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from mlora.batch.errors import ModelError
from mlora.batch.model.lora import config_role_shapes, group_shapes

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class TPLayout:
    """Rank ``rank`` of a tensor-parallel group of ``size`` ranks."""

    rank: int
    size: int

    def __post_init__(self):
        for name in ("rank", "size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ModelError("E_TP_LAYOUT", f"the tensor-parallel {name} must be an integer, got {value!r}")
        if self.size < 1:
            raise ModelError("E_TP_LAYOUT", f"the tensor-parallel size must be at least 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ModelError("E_TP_LAYOUT", f"rank {self.rank} is outside a group of {self.size} "
                                            f"(ranks 0 to {self.size - 1})")

    def part(self, n: int, axis: int = 0) -> Cut:
        """This rank's equal share of ``n`` elements of ``axis`` (``n`` a multiple of the size)."""
        share = n // self.size
        return Cut(axis, self.rank * share, (self.rank + 1) * share)


@dataclass(frozen=True)
class Cut:
    """The interval [start, stop) of one axis of a tensor: the part a rank holds."""

    axis: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start

    def index(self) -> tuple[slice, ...]:
        """The subscript that takes the cut: ``t[cut.index()]`` (a safetensors slice takes it too)."""
        return (slice(None),) * self.axis + (slice(self.start, self.stop),)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.index()]


# ---------------------------------------------------------------- the base


def _misfits(config, size: int) -> list[str]:
    c = config
    misfits = []
    if c.num_heads % size:
        misfits.append(f"num_attention_heads {c.num_heads}")
    if size % c.num_kv_heads and c.num_kv_heads % size:
        misfits.append(f"num_key_value_heads {c.num_kv_heads} (nor is it a multiple of them, each kv head replicated)")
    if c.intermediate_size % size:
        misfits.append(f"intermediate_size {c.intermediate_size}")
    if c.hidden_size % size:
        misfits.append(f"hidden_size {c.hidden_size} (the o and down adapter outputs are cut by it)")
    return misfits


def tp_sizes(config) -> list[int]:
    """Every tensor-parallel size a ``ModelConfig`` can be cut into (at most one head per rank)."""
    return [n for n in range(1, config.num_heads + 1) if not _misfits(config, n)]


def check_size(config, size: int) -> None:
    """Refuse (``E_TP_SHAPE``) a size that does not divide the model, naming the sizes that do."""
    misfits = _misfits(config, size)
    if misfits:
        sizes = ", ".join(map(str, tp_sizes(config)))
        raise ModelError("E_TP_SHAPE", f"tensor-parallel size {size} does not divide {'; '.join(misfits)}: "
                                       f"use a size that divides this model ({sizes})")


def kv_heads(config, layout: TPLayout) -> tuple[int, int]:
    """(first kv head, count) of the kv heads the rank's q heads read: H_kv/N of them, or the one
    they all share when N > H_kv (each kv head then replicated on N/H_kv ranks)."""
    n, kv = layout.size, config.num_kv_heads
    if n <= kv:
        return layout.rank * (kv // n), kv // n
    return layout.rank * kv // n, 1


def shard_config(config, layout: TPLayout):
    """The ``ModelConfig`` of the rank's part of the model: its heads, kv heads and intermediate
    columns; hidden size, vocabulary and head_dim whole. ``E_TP_SHAPE`` where the size does not divide."""
    check_size(config, layout.size)
    return replace(config, num_heads=config.num_heads // layout.size, num_kv_heads=kv_heads(config, layout)[1],
                   intermediate_size=config.intermediate_size // layout.size)


def weight_cuts(config, layout: TPLayout) -> dict[str, Cut]:
    """role -> the cut of its base weight [d_out, d_in] the rank holds: rows (axis 0) for the
    column-parallel roles (their biases take the same rows), columns (axis 1) for the
    row-parallel ones (o's bias stays whole). Every other tensor is whole on every rank."""
    check_size(config, layout.size)
    c = config
    q = layout.part(c.q_out)
    first, count = kv_heads(config, layout)
    kv = Cut(0, first * c.head_dim, (first + count) * c.head_dim)
    inter = layout.part(c.intermediate_size)
    return {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": Cut(1, q.start, q.stop),
            "gate_proj": inter, "up_proj": inter, "down_proj": Cut(1, inter.start, inter.stop)}


# ---------------------------------------------------------------- adapters


@dataclass(frozen=True)
class LoraCut:
    """What a rank holds of one module's factors (A [r, d_in], B [d_out, r]) and where its delta
    goes: ``a`` None means A whole; ``out_start`` is the first column of the module's output
    on the rank (its local slice for column-parallel roles, the full hidden width for row-parallel
    ones) that the rank's ``b.length`` delta columns are added at."""

    a: Cut | None
    b: Cut
    out_start: int


def lora_cuts(config, layout: TPLayout) -> dict[str, LoraCut]:
    """role -> its ``LoraCut`` on the rank (module docstring: column-parallel A whole, B by the
    base's rows; row-parallel A by the base's input columns, B by hidden rows [j h/N, (j+1) h/N))."""
    hidden = layout.part(config.hidden_size)
    cuts = {}
    for role, cut in weight_cuts(config, layout).items():
        if cut.axis == 0:
            cuts[role] = LoraCut(None, cut, 0)
        else:
            cuts[role] = LoraCut(Cut(1, cut.start, cut.stop), hidden, hidden.start)
    return cuts


def shard_lora(role: str, a: torch.Tensor, b: torch.Tensor, config, layout: TPLayout
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's (A, B) of one module's checkpoint-oriented factors (views of ``a`` and ``b``)."""
    cut = lora_cuts(config, layout)[role]
    return (a if cut.a is None else cut.a.take(a)), cut.b.take(b)


def bank_shapes(config, layout: TPLayout) -> tuple[dict[str, tuple[int, tuple[int, ...]]], dict[str, int]]:
    """(group -> (d_in, slice widths) of the factors the rank holds, in ``lora.group_shapes``'
    form; row-parallel group -> the first output column its delta is added at): q/k/v and
    gate/up at the rank's output widths with A whole, o and down at the rank's input columns
    with ``h/N`` output columns from ``out_start``."""
    c = shard_config(config, layout)
    cuts = lora_cuts(config, layout)
    shapes = group_shapes(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim)
    starts = {}
    for group, role in (("o", "o_proj"), ("down", "down_proj")):
        shapes[group] = (shapes[group][0], (cuts[role].b.length,))
        starts[group] = cuts[role].out_start
    return shapes, starts


def lora_elements(config, layout: TPLayout, rank: int, roles=COLUMN_PARALLEL + ROW_PARALLEL) -> int:
    """Factor elements one adapter of rank ``rank`` on ``roles`` occupies on the rank, all layers."""
    shapes = config_role_shapes(config)
    cuts = lora_cuts(config, layout)
    per_layer = 0
    for role in roles:
        d_in = shapes[role][1] if cuts[role].a is None else cuts[role].a.length
        per_layer += rank * d_in + cuts[role].b.length * rank
    return per_layer * config.num_layers


# ---------------------------------------------------------------- reference math


def gather_rank_axis(parts: list[torch.Tensor]) -> torch.Tensor:
    """All-gather on the rank axis: every rank's bottleneck slice, side by side in rank order."""
    return torch.cat(parts, dim=-1)


def reduce_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """All-reduce with addition."""
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return total


class ColumnParallel(NamedTuple):
    bottlenecks: list[torch.Tensor]  # Z_j, each rank's shrink
    z: torch.Tensor  # the gathered bottleneck
    deltas: list[torch.Tensor]  # D_j, each rank's output columns


class RowParallel(NamedTuple):
    partials: list[torch.Tensor]  # P_j, each rank's partial shrink
    z: torch.Tensor  # the reduced bottleneck
    deltas: list[torch.Tensor]  # D_j, each rank's output slice
    y: torch.Tensor  # the final all-reduce of base partials plus placed slices


def column_parallel_delta(x: torch.Tensor, a_parts: list[torch.Tensor], b_parts: list[torch.Tensor],
                          gather: Callable[[list[torch.Tensor]], torch.Tensor] = gather_rank_axis) -> ColumnParallel:
    """The column-parallel LoRA over per-rank factors. Semantics::

        Z_j = x A_j^T          (A_j: A's rank-axis rows of rank j, or ``a_parts = [A]``: A whole,
        Z   = gather(Z_0..)     each rank computing Z itself and the gather a no-op)
        D_j = Z B_j^T          (B_j: rank j's output rows of B)

    concat_j D_j = x A^T B^T where the B_j tile B's rows."""
    bottlenecks = [x @ a.T for a in a_parts]
    z = gather(bottlenecks)
    return ColumnParallel(bottlenecks, z, [z @ b.T for b in b_parts])


def row_parallel_output(h_parts: list[torch.Tensor], a_parts: list[torch.Tensor], b_parts: list[torch.Tensor],
                        base_partials: list[torch.Tensor],
                        reduce: Callable[[list[torch.Tensor]], torch.Tensor] = reduce_sum) -> RowParallel:
    """The row-parallel projection with its LoRA over per-rank tensors. Semantics::

        P_j = H_j A_j^T              (H_j, A_j: rank j's input columns)
        Z   = reduce(P_0..)          (an all-reduce with addition)
        D_j = Z B_j^T                (B_j: rank j's rows of B, consecutive slices of the output)
        Y   = sum_j (Y_base_j + E_j(D_j))   (E_j: D_j placed at rank j's output columns)

    Y = H W^T + H A^T B^T where the Y_base_j are the partials H_j W_j^T."""
    partials = [h @ a.T for h, a in zip(h_parts, a_parts)]
    z = reduce(partials)
    deltas = [z @ b.T for b in b_parts]
    placed, start = [], 0
    for y_j, d_j in zip(base_partials, deltas):
        y_j = y_j.clone()
        y_j[:, start:start + d_j.shape[1]] += d_j
        placed.append(y_j)
        start += d_j.shape[1]
    return RowParallel(partials, z, deltas, reduce_sum(placed))
