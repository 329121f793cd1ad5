"""SegmentPlan: the row-to-slot metadata of one model invocation (docs/design.md, Segment plan).

Owns the indexed realization of segmented LoRA metadata: active rows grouped
by slot with a stable sort (the permutation ``g``), one segment per active
slot, CSR-like ``starts`` offsets, and the invariants of the encoding below with a
validator that names the broken one. Built once per invocation and shared by
every layer. Must not import anything else from mlora.

Encoding (base-only rows, ``row_slots[t] == -1``, are compacted away)::

    row_slots     int32 [T]       slot of scheduler row t, -1 = base only
    sorted_rows   int32 [N]       g: active rows, grouped by slot, stable
    slot_ids      int32 [A]       active slots, ascending (segment t uses slot_ids[t])
    counts        int32 [A]       rows per segment, all > 0
    starts        int32 [A + 1]   starts[0] = 0, starts[t+1] = starts[t] + counts[t], starts[-1] = N

Worked example: row_slots [0, 1, 0, -1, 1, 1, 0, -1] gives
sorted_rows [0, 2, 6, 1, 4, 5], slot_ids [0, 1], starts [0, 3, 6].
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


class PlanError(ValueError):
    """A malformed plan or slot bank. ``code`` names the broken invariant."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(frozen=True)
class SegmentPlan:
    num_rows: int
    sorted_rows: torch.Tensor
    slot_ids: torch.Tensor
    counts: torch.Tensor
    starts: torch.Tensor
    max_count: int
    generation: int = 0

    @property
    def num_active(self) -> int:
        return int(self.sorted_rows.numel())

    @property
    def num_segments(self) -> int:
        return int(self.slot_ids.numel())

    def to(self, device) -> "SegmentPlan":
        """The same plan with its tensors on ``device``."""
        mv = dict(device=device, non_blocking=True)
        return SegmentPlan(self.num_rows, self.sorted_rows.to(**mv), self.slot_ids.to(**mv), self.counts.to(**mv),
                           self.starts.to(**mv), self.max_count, self.generation)


@contextlib.contextmanager
def serial_on_host(device: torch.device):
    """Plan building on the host runs on the calling thread alone (``torch.set_num_threads(1)``
    around it, the previous count restored; no-op for device tensors). An engine builds a plan
    per invocation on its critical path, and torch splits ops over an 8,192-row prefill
    chunk's tensors across its intra-op threads: when another process holds a core, each such
    op waited for a descheduled worker thread, ~8 ms a time slice. Measured on a 2-core VM
    with a test run beside it: build_plan + make_launch_plan of 8,192 rows took 36-40 ms
    median with 2 threads and 0.4-0.6 ms with 1 (the same 0.4 ms either way on an idle CPU);
    up to 1,024 rows nothing splits. The OpenMP thread count set here is the calling
    thread's (other threads keep theirs)."""
    saved = torch.get_num_threads()
    if device.type != "cpu" or saved == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def build_plan(row_slots: torch.Tensor, generation: int = 0) -> SegmentPlan:
    """Group the active rows of ``row_slots`` by slot (stable: rows of one slot
    keep scheduler order). One sort, no Python loop over rows or slots; on the
    host on one thread (:func:`serial_on_host`)."""
    if row_slots.dim() != 1:
        raise PlanError("E_PLAN_SHAPE", f"row_slots must be 1-D, got shape {tuple(row_slots.shape)}")
    if row_slots.dtype not in (torch.int32, torch.int64):
        raise PlanError("E_PLAN_DTYPE", f"row_slots must be int32 or int64, got {row_slots.dtype}")
    with serial_on_host(row_slots.device):
        return _group(row_slots, generation)


def _group(row_slots: torch.Tensor, generation: int) -> SegmentPlan:
    device = row_slots.device
    active = torch.nonzero(row_slots >= 0, as_tuple=True)[0]
    slots = row_slots[active].to(torch.int64)
    order = torch.sort(slots, stable=True).indices
    sorted_rows = active[order].to(torch.int32)
    slot_ids, counts = torch.unique_consecutive(slots[order], return_counts=True)
    starts = torch.zeros(slot_ids.numel() + 1, dtype=torch.int32, device=device)
    starts[1:] = torch.cumsum(counts, 0)
    return SegmentPlan(
        num_rows=int(row_slots.numel()),
        sorted_rows=sorted_rows,
        slot_ids=slot_ids.to(torch.int32),
        counts=counts.to(torch.int32),
        starts=starts,
        max_count=int(counts.max()) if counts.numel() else 0,
        generation=generation,
    )


def validate_plan(
    plan: SegmentPlan,
    row_slots: torch.Tensor,
    num_slots: int,
    ranks: torch.Tensor | None = None,
    max_rank: int | None = None,
    expected_generation: int | None = None,
) -> None:
    """Check every invariant of the encoding (module docstring); raise PlanError naming the first
    broken one. A debugging and test tool: it syncs with the device."""
    rs = row_slots.detach().to("cpu", torch.int64)
    g = plan.sorted_rows.detach().to("cpu", torch.int64)
    ids = plan.slot_ids.detach().to("cpu", torch.int64)
    counts = plan.counts.detach().to("cpu", torch.int64)
    starts = plan.starts.detach().to("cpu", torch.int64)
    T = rs.numel()
    if plan.num_rows != T:
        raise PlanError("E_PLAN_ROWS", f"plan is for {plan.num_rows} rows, row_slots has {T}")
    if ((rs < -1) | (rs >= num_slots)).any():
        bad = int(torch.nonzero((rs < -1) | (rs >= num_slots))[0])
        raise PlanError("E_PLAN_SLOT_RANGE", f"row {bad} names slot {int(rs[bad])}, bank has {num_slots}")
    if ((g < 0) | (g >= T)).any():
        raise PlanError("E_PLAN_ROW_BOUNDS", "sorted_rows holds a row index outside [0, T)")
    if g.unique().numel() != g.numel():
        raise PlanError("E_PLAN_DUPLICATE_ROW", "a row appears twice in sorted_rows")
    if (rs[g] < 0).any() if g.numel() else False:
        raise PlanError("E_PLAN_BASE_ROW", "a base-only row (slot -1) is in sorted_rows")
    if g.numel() != int((rs >= 0).sum()):
        raise PlanError("E_PLAN_MISSING_ROW", "an active row is missing from sorted_rows")
    if not (len(ids) == len(counts) == len(starts) - 1):
        raise PlanError("E_PLAN_LENGTHS", "slot_ids, counts and starts lengths disagree")
    if starts.numel() == 0 or starts[0] != 0 or starts[-1] != g.numel():
        raise PlanError("E_PLAN_OFFSETS", "starts must begin at 0 and end at the number of active rows")
    if not torch.equal(starts[1:] - starts[:-1], counts):
        raise PlanError("E_PLAN_COUNTS", "counts disagree with the differences of starts")
    if (counts <= 0).any():
        raise PlanError("E_PLAN_EMPTY_SEGMENT", "a segment has no rows")
    if ((ids < 0) | (ids >= num_slots)).any():
        raise PlanError("E_PLAN_SLOT_RANGE", "a segment names a slot outside the bank")
    if ids.numel() > 1 and not (ids[1:] > ids[:-1]).all():
        raise PlanError("E_PLAN_SEGMENT_ORDER", "slot_ids must be strictly increasing (one segment per slot)")
    for t in range(ids.numel()):
        seg = g[starts[t] : starts[t + 1]]
        if not (rs[seg] == ids[t]).all():
            raise PlanError("E_PLAN_SEGMENT_SLOT", f"segment {t} holds a row of another slot than {int(ids[t])}")
        if seg.numel() > 1 and not (seg[1:] > seg[:-1]).all():
            raise PlanError("E_PLAN_UNSTABLE", f"segment {t} is not in scheduler order")
    if plan.max_count != (int(counts.max()) if counts.numel() else 0):
        raise PlanError("E_PLAN_COUNTS", "max_count disagrees with counts")
    if ranks is not None:
        r = ranks.detach().to("cpu", torch.int64)
        if r.numel() != num_slots:
            raise PlanError("E_BANK_RANKS", f"ranks has {r.numel()} entries for {num_slots} slots")
        if max_rank is not None and ((r < 0) | (r > max_rank)).any():
            raise PlanError("E_BANK_RANK_EXCEEDS_R", f"a slot rank is outside [0, R={max_rank}]")
    if expected_generation is not None and plan.generation != expected_generation:
        raise PlanError("E_PLAN_GENERATION", f"plan generation {plan.generation} != expected {expected_generation}")
