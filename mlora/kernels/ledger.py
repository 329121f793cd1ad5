"""Row bookkeeping of one mixed iteration: runs, row expansion, rank ledger.

Owns the integer accounting that sits beside a SegmentPlan and never touches
a tensor of activations or factors:

* :func:`contiguous_runs` - maximal runs of one slot in scheduler order, the
  sentinel-inclusive ``segment_adapter`` / ``segment_offsets``;
* :func:`expand_request_rows` - request-level slots expanded to one slot per
  token row (a prefill request contributes all its rows);
* :func:`rank_ledger` - true-rank versus padded-rank work (docs/design.md, Logical
  and physical rank), in plain ints and Fractions so the numbers compare exactly;
* :func:`adapter_bytes` - true-rank factor bytes of the slots a batch uses.

Imports nothing from mlora except ``.plan`` (for PlanError); no floats.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch

from mlora.kernels.plan import PlanError


def _ints(values) -> list[int]:
    if isinstance(values, torch.Tensor):
        return [int(v) for v in values.detach().cpu().reshape(-1).tolist()]
    return [int(v) for v in values]


def contiguous_runs(row_slots) -> tuple[list[int], list[int]]:
    """Maximal runs of equal consecutive slots (base-only ``-1`` is a run too).

    Returns ``(run_slots, run_offsets)`` with ``run_offsets[0] = 0`` and
    ``run_offsets[-1] = T``; run k covers rows ``[run_offsets[k], run_offsets[k+1])``.
    A final offset other than T is the detectable failure of one row per prefill request.
    """
    slots = _ints(row_slots)
    run_slots: list[int] = []
    run_offsets = [0]
    for i, s in enumerate(slots):
        if run_slots and run_slots[-1] == s:
            continue
        if run_slots:
            run_offsets.append(i)
        run_slots.append(s)
    if run_slots:
        run_offsets.append(len(slots))
    return run_slots, run_offsets


def expand_request_rows(request_slots, request_rows) -> torch.Tensor:
    """Row slots of an iteration from its requests in packed order.

    Request q contributes ``request_rows[q]`` consecutive rows of slot
    ``request_slots[q]``: its prompt length in prefill, 1 in one-token decode.
    Returns int32 [sum(request_rows)].
    """
    slots, rows = _ints(request_slots), _ints(request_rows)
    if len(slots) != len(rows):
        raise PlanError("E_PLAN_ROW_EXPANSION", f"{len(slots)} request slots but {len(rows)} row counts")
    if any(n < 0 for n in rows):
        bad = next(q for q, n in enumerate(rows) if n < 0)
        raise PlanError("E_PLAN_ROW_EXPANSION", f"request {bad} contributes {rows[bad]} rows")
    return torch.repeat_interleave(torch.tensor(slots, dtype=torch.int32), torch.tensor(rows, dtype=torch.int64))


@dataclass(frozen=True)
class RankLedger:
    """Logical work of one LoRA branch at true rank and at physical rank R."""

    active_rows: int  # N_active
    true_rank_rows: int  # sum_i r_a(i)
    padded_rank_rows: int  # N_active * R: the padded intermediate
    wasted_rank_rows: int  # U_r = padded - true
    true_flops: int  # 2 (d_in + d_out) sum_i r_a(i)
    padded_flops: int  # 2 N_active R (d_in + d_out)
    padding_ratio: Fraction | None  # padded / true; None when no rank-row is live


def _active_ranks(row_slots, ranks) -> tuple[list[int], list[int]]:
    slots = [s for s in _ints(row_slots) if s >= 0]
    table = _ints(ranks)
    if any(s >= len(table) for s in slots):
        raise PlanError("E_PLAN_SLOT_RANGE", f"a row names a slot outside the rank table of {len(table)}")
    return slots, table


def rank_ledger(row_slots, ranks, max_rank: int, d_in: int, d_out: int) -> RankLedger:
    """True-rank and padded-rank ledger of the active rows of ``row_slots``."""
    slots, table = _active_ranks(row_slots, ranks)
    if any(table[s] < 0 or table[s] > max_rank for s in slots):
        raise PlanError("E_BANK_RANK_EXCEEDS_R", f"an active slot's rank is outside [0, R={max_rank}]")
    true_rank_rows = sum(table[s] for s in slots)
    padded_rank_rows = len(slots) * max_rank
    return RankLedger(
        active_rows=len(slots),
        true_rank_rows=true_rank_rows,
        padded_rank_rows=padded_rank_rows,
        wasted_rank_rows=padded_rank_rows - true_rank_rows,
        true_flops=2 * (d_in + d_out) * true_rank_rows,
        padded_flops=2 * (d_in + d_out) * padded_rank_rows,
        padding_ratio=Fraction(padded_rank_rows, true_rank_rows) if true_rank_rows else None,
    )


def adapter_bytes(row_slots, ranks, d_in: int, d_out: int, itemsize: int) -> int:
    """Bytes of A and B at true rank, once per distinct slot used by an active row."""
    slots, table = _active_ranks(row_slots, ranks)
    return sum(table[s] * (d_in + d_out) * itemsize for s in set(slots))
