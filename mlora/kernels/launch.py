"""LaunchPlan: the static-shape tile list the Triton kernels launch over.

Owns the translation of a :class:`SegmentPlan` (one segment per active slot)
into a list of ``(slot, first grouped row, segment end)`` tiles of at most
``block_m`` rows, one per active (slot, row tile) pair, padded to a fixed
capacity so that the launch grid depends only on the capacity, never on the
data. That is what makes the kernels capturable in a CUDA graph for a fixed
maximum token count: the engine allocates one LaunchPlan per captured batch
size with :func:`empty_launch_plan`, and before each replay copies the
current step's plan into it with :meth:`LaunchPlan.copy_from` (no host sync,
no reallocation). Programs whose tile index is ``>= num_tiles`` exit at once.

Encoding (``u`` indexes the grouped row order of the SegmentPlan)::

    sorted_rows  int32 [row_capacity]   scheduler row of grouped row u (first N valid)
    tile_slot    int32 [tile_capacity]  slot of tile i (-1 past num_tiles)
    tile_start   int32 [tile_capacity]  first grouped row u of tile i
    tile_end     int32 [tile_capacity]  end of tile i's segment; the tile covers
                                        [tile_start, min(tile_start + block_m, tile_end))
    num_tiles    int32 [1]              valid tiles (a device scalar, read by the kernels)
    base_rows    int32 [row_capacity]   the scheduler rows with no adapter (slot -1), in row
                                        order (first num_base valid): the rows a kernel that
                                        writes every row (the fused SiLU product) covers apart
    num_base     int32 [1]              valid base rows

A segment of ``c`` rows contributes ``ceil(c / block_m)`` tiles, so ``N``
active rows over ``A`` active slots need at most ``(N + A*(block_m-1)) //
block_m`` tiles: :func:`tile_capacity` gives that bound for a batch size.
Building is pure tensor work (sort-free: the SegmentPlan already grouped the
rows) and does not synchronise with the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from mlora.kernels.plan import SegmentPlan, build_plan, serial_on_host


@dataclass(frozen=True)
class LaunchPlan:
    sorted_rows: torch.Tensor
    tile_slot: torch.Tensor
    tile_start: torch.Tensor
    tile_end: torch.Tensor
    num_tiles: torch.Tensor
    block_m: int
    base_rows: torch.Tensor
    num_base: torch.Tensor
    # what fill_from_rows last copied into these buffers: {"rows": row slots, "plan": their SegmentPlan}
    _filled: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def row_capacity(self) -> int:
        return int(self.sorted_rows.numel())

    @property
    def tile_capacity(self) -> int:
        return int(self.tile_slot.numel())

    @property
    def device(self) -> torch.device:
        return self.tile_slot.device

    def to(self, device) -> "LaunchPlan":
        """The same plan with its buffers on ``device`` (a plan built on the host
        from the scheduler's row slots is moved with one copy per buffer, no sync)."""
        mv = dict(device=device, non_blocking=True)
        return LaunchPlan(self.sorted_rows.to(**mv), self.tile_slot.to(**mv), self.tile_start.to(**mv),
                          self.tile_end.to(**mv), self.num_tiles.to(**mv), self.block_m, self.base_rows.to(**mv),
                          self.num_base.to(**mv))

    def copy_from(self, other: "LaunchPlan") -> "LaunchPlan":
        """Copy ``other`` (same block_m, no larger) into this plan's buffers in place
        (stream-ordered, no sync); returns self. Used before a CUDA graph replay."""
        if other.block_m != self.block_m:
            raise ValueError(f"block_m {other.block_m} != {self.block_m}: capture a graph per block size")
        if (other.row_capacity > self.row_capacity or other.tile_capacity > self.tile_capacity
                or other.base_rows.numel() > self.base_rows.numel()):
            raise ValueError(
                f"plan needs {other.row_capacity} rows / {other.tile_capacity} tiles / {other.base_rows.numel()} "
                f"base rows, buffers hold {self.row_capacity} / {self.tile_capacity} / {self.base_rows.numel()}"
            )
        n, k = other.row_capacity, other.tile_capacity
        self._filled.clear()
        self.sorted_rows[:n].copy_(other.sorted_rows, non_blocking=True)
        self.tile_slot[:k].copy_(other.tile_slot, non_blocking=True)
        self.tile_start[:k].copy_(other.tile_start, non_blocking=True)
        self.tile_end[:k].copy_(other.tile_end, non_blocking=True)
        self.num_tiles.copy_(other.num_tiles, non_blocking=True)
        self.base_rows[: other.base_rows.numel()].copy_(other.base_rows, non_blocking=True)
        self.num_base.copy_(other.num_base, non_blocking=True)
        return self

    def fill_from_rows(self, row_slots: torch.Tensor) -> SegmentPlan:
        """Make these (static) buffers hold the tile list of ``row_slots`` (host int32, -1 = no
        adapter) and return its SegmentPlan, built on the host (no sync). When the row slots
        are those of this plan's last fill (consecutive decode steps of a captured graph),
        nothing is built or copied; ``copy_from`` from elsewhere forgets the last fill."""
        rows = tuple(row_slots.tolist())
        if self._filled.get("rows") == rows:
            return self._filled["plan"]
        plan = build_plan(row_slots)
        self.copy_from(make_launch_plan(plan, block_m=self.block_m))
        self._filled.update(rows=rows, plan=plan)
        return plan


def tile_capacity(num_rows: int, num_slots: int, block_m: int) -> int:
    """Most tiles ``num_rows`` active rows spread over at most ``num_slots`` slots can need."""
    active_slots = min(num_rows, num_slots)
    return max(1, (num_rows + active_slots * (block_m - 1)) // block_m)


DECODE_BLOCK_M = 16  # row tile of decode batches (below 1024 rows choose_block_m gives 16)


def choose_block_m(num_active: int, num_segments: int) -> int:
    """Row tile for a batch (figures in BENCHMARKS.md): 16, the smallest tensor-core tile, for decode-like and
    mid-size batches; 32 for large batches with long segments (>= 1024 rows,
    >= 32 rows per slot on average), where fewer, larger tiles cut the
    re-reads of B."""
    mean = num_active / max(num_segments, 1)
    return 32 if num_active >= 1024 and mean >= 32 else 16


def empty_launch_plan(row_capacity: int, tile_capacity: int, block_m: int, device) -> LaunchPlan:
    """Static buffers for a captured batch size; holds no tiles until ``copy_from``."""
    i32 = dict(dtype=torch.int32, device=device)
    return LaunchPlan(
        sorted_rows=torch.zeros(row_capacity, **i32),
        tile_slot=torch.full((tile_capacity,), -1, **i32),
        tile_start=torch.zeros(tile_capacity, **i32),
        tile_end=torch.zeros(tile_capacity, **i32),
        num_tiles=torch.zeros(1, **i32),
        block_m=block_m,
        base_rows=torch.zeros(row_capacity, **i32),
        num_base=torch.zeros(1, **i32),
    )


def base_rows_of(plan: SegmentPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(every row of ``plan``'s invocation, the rows with no adapter first and in row order,
    then the others; how many have no adapter as an int32 [1]), on the plan's device, with
    no synchronisation (a stable sort of the 0/1 "has an adapter" flags)."""
    device = plan.starts.device
    flags = torch.zeros(plan.num_rows, dtype=torch.int32, device=device)
    flags[plan.sorted_rows.to(torch.int64)] = 1
    rows = torch.sort(flags, stable=True).indices.to(torch.int32)
    num_base = torch.full((1,), plan.num_rows - int(plan.sorted_rows.numel()), dtype=torch.int32, device=device)
    return rows, num_base


def make_launch_plan(plan: SegmentPlan, block_m: int | None = None) -> LaunchPlan:
    """The tile list of ``plan`` (on the plan's device), sized to its own bound; on the host
    on one thread (``plan.serial_on_host``)."""
    with serial_on_host(plan.starts.device):
        return _tiles(plan, block_m)


def _tiles(plan: SegmentPlan, block_m: int | None) -> LaunchPlan:
    if block_m is None:
        block_m = choose_block_m(plan.num_active, plan.num_segments)
    device = plan.starts.device
    i32 = dict(dtype=torch.int32, device=device)
    n_seg = plan.num_segments
    cap = tile_capacity(plan.num_active, n_seg, block_m) if n_seg else 1
    base_rows, num_base = base_rows_of(plan)
    if n_seg == 0:
        empty = empty_launch_plan(max(plan.num_active, 1), cap, block_m, device)
        return replace(empty, base_rows=base_rows, num_base=num_base)
    counts = plan.counts.to(torch.int64)
    per_seg = (counts + block_m - 1) // block_m
    cum = torch.cumsum(per_seg, 0)
    i = torch.arange(cap, device=device, dtype=torch.int64)
    seg = torch.searchsorted(cum, i, right=True)
    valid = seg < n_seg
    seg_c = seg.clamp(max=n_seg - 1)
    first_tile = cum[seg_c] - per_seg[seg_c]
    starts = plan.starts.to(torch.int64)
    return LaunchPlan(
        sorted_rows=plan.sorted_rows.to(**i32),
        tile_slot=torch.where(valid, plan.slot_ids.to(torch.int64)[seg_c], -1).to(**i32),
        tile_start=(starts[seg_c] + (i - first_tile) * block_m).to(**i32),
        tile_end=starts[seg_c + 1].to(**i32),
        num_tiles=cum[-1:].to(**i32),
        block_m=block_m,
        base_rows=base_rows,
        num_base=num_base,
    )
