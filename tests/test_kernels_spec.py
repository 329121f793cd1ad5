"""Two worked examples of the spec, exact on every path.

The mixed prefill/decode trace with ranks 2, 3 and 1 in a physical rank-3 bank
(docs/design.md: ``doff`` and ``prefill_indptr``, Logical and physical rank), and
the five-row table with two rank-2 adapters of different scales. Each expected
number is first recomputed from the factors in Fractions and compared with the
table the spec publishes; then the oracle, the loop, the gather-bmm path and
add_lora (torch, triton) must reproduce it bit for bit in fp32 and bf16, with
NaN wherever nothing may be read (base-only inputs, padded rank tails).
"""

import dataclasses
from fractions import Fraction as F

import pytest
import torch

from mlora.kernels import PlanError, add_lora, build_plan, lora_gather_bmm, lora_loop, lora_oracle_f64, validate_plan
from mlora.kernels.ledger import adapter_bytes, contiguous_runs, expand_request_rows, rank_ledger

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PATHS = ["oracle", "loop", "gather_bmm", "torch", "triton"]
DTYPES = [torch.float32, torch.bfloat16]
NAN = float("nan")


# ---- exact arithmetic and case building ---------------------------------------------


def shrink(x, a):
    """z = x A^T over Fractions (a: rank rows of A)."""
    return [sum(F(xk) * ak for xk, ak in zip(x, row)) for row in a]


def expand(scale, z, b):
    """scale * z B^T over Fractions (b: d_out rows of B)."""
    return [F(scale) * sum(zk * bk for zk, bk in zip(z, row)) for row in b]


def exact_delta(factors, scales, slots, xs, d_out):
    return [[F(0)] * d_out if s < 0 else expand(scales[s], shrink(xs[i], factors[s][0]), factors[s][1])
            for i, s in enumerate(slots)]


def plus(p, q):
    return [[F(u) + v for u, v in zip(pr, qr)] for pr, qr in zip(p, q)]


def as_f64(table):
    return torch.tensor([[float(v) for v in row] for row in table], dtype=torch.float64)


def make_case(factors, ranks, scales, slots, xs, y_base, R, dtype):
    """(y, x, a, b, row_slots, ranks, scales); x of base-only rows and rank tails are NaN."""
    d_in, d_out = len(factors[0][0][0]), len(factors[0][1])
    a = torch.full((len(factors), R, d_in), NAN, dtype=dtype)
    b = torch.full((len(factors), d_out, R), NAN, dtype=dtype)
    for s, (fa, fb) in enumerate(factors):
        a[s, : len(fa)] = as_f64(fa)
        b[s, :, : len(fa)] = as_f64(fb)
    x = torch.tensor([[NAN] * d_in if v is None else [float(u) for u in v] for v in xs], dtype=dtype)
    return (as_f64(y_base).to(dtype), x, a, b, torch.tensor(slots, dtype=torch.int32),
            torch.tensor(ranks, dtype=torch.int32), torch.tensor([float(s) for s in scales]))


def run(path, y, x, a, b, row_slots, ranks, scales, plan=None):
    """Run one path on a copy of y; check in-place update and untouched base rows; float64 on the CPU."""
    base = row_slots < 0
    if path == "oracle":
        out = lora_oracle_f64(y, x, a, b, row_slots, ranks, scales)
        assert torch.equal(out[base], y[base].double())
        return out
    if path == "triton":
        y, x, a, b, row_slots, base = (t.to(DEVICE) for t in (y, x, a, b, row_slots, base))
        ranks, scales = (None if t is None else t.to(DEVICE) for t in (ranks, scales))
    y0, y = y, y.clone()
    if path in ("loop", "gather_bmm"):
        out = {"loop": lora_loop, "gather_bmm": lora_gather_bmm}[path](y, x, a, b, row_slots, ranks, scales)
    else:
        out = add_lora(y, x, a, b, row_slots, ranks=ranks, scales=scales, backend=path, plan=plan)
    assert out is y
    assert torch.equal(out[base], y0[base])  # bit-identical, NaN inputs notwithstanding
    return out.cpu().double()


# ---- the mixed trace --------------------------------------------------------------------

# slots: a = 0, b = 1, c = 2; each entry is (A [r, d_in], B [d_out, r])
MIXED_FACTORS = [
    ([[1, 0, 1], [0, 1, -1]], [[1, 2], [-1, 1]]),
    ([[1, 1, 0], [0, 1, 1], [0, 0, 1]], [[1, 0, 1], [0, 1, -1]]),
    ([[1, -1, 1]], [[2], [1]]),
]
MIXED_RANKS, MIXED_SCALES = [2, 3, 1], [F(1, 2), F(1), F(2)]
MIXED_SLOTS = [1, 1, 0, 0, 0, 0, -1, 2]  # packed [p1, p1, p0, p0, p0 | d0, d1, d2]
MIXED_X = [[-2, 3, -1], [2, 0, 1], [1, 0, 1], [0, 2, 1], [3, 0, -1], [1, -1, 2], None, [1, 1, 1]]
MIXED_Y_BASE = [[i + 1, -(i + 1)] for i in range(8)]
SPEC_Z = [[1, 2, -1], [2, 1, 1], [2, -1], [1, 1], [2, 1], [3, -3], [], [1]]
SPEC_D = [[0, 3], [3, 0], [0, F(-3, 2)], [F(3, 2), 0], [2, F(-1, 2)], [F(-3, 2), -3], [0, 0], [4, 2]]


def mixed_case(dtype, slots=MIXED_SLOTS, xs=MIXED_X, y_base=MIXED_Y_BASE):
    return make_case(MIXED_FACTORS, MIXED_RANKS, MIXED_SCALES, slots, xs, y_base, 3, dtype)


def test_mixed_trace_runs_and_row_expansion():
    assert contiguous_runs(MIXED_SLOTS) == ([1, 0, -1, 2], [0, 2, 6, 7, 8])
    packed = expand_request_rows([1, 0, 0, -1, 2], [2, 3, 1, 1, 1])  # [p1, p0, d0, d1, d2]
    assert packed.dtype == torch.int32 and packed.tolist() == MIXED_SLOTS
    # one row per prefill request instead of one per token; o_K = T detects it
    _, offsets = contiguous_runs(expand_request_rows([1, 0, 0, -1, 2], [1] * 5))
    assert offsets[-1] != len(MIXED_SLOTS)
    assert contiguous_runs([]) == ([], [0])
    assert expand_request_rows([], []).tolist() == []


@pytest.mark.parametrize("slots, rows", [([1, 0], [2]), ([1, 0], [2, -1])])
def test_row_expansion_refuses_bad_counts(slots, rows):
    with pytest.raises(PlanError) as exc:
        expand_request_rows(slots, rows)
    assert exc.value.code == "E_PLAN_ROW_EXPANSION"


def test_mixed_trace_plan_metadata():
    rs = torch.tensor(MIXED_SLOTS, dtype=torch.int32)
    plan = build_plan(rs)
    assert plan.sorted_rows.tolist() == [2, 3, 4, 5, 0, 1, 7]
    assert plan.slot_ids.tolist() == [0, 1, 2]
    assert plan.starts.tolist() == [0, 4, 6, 7]
    validate_plan(plan, rs, num_slots=3, ranks=torch.tensor(MIXED_RANKS), max_rank=3)


def test_mixed_trace_rank_ledger():
    led = rank_ledger(MIXED_SLOTS, MIXED_RANKS, max_rank=3, d_in=3, d_out=2)
    assert (led.active_rows, led.true_rank_rows, led.padded_rank_rows, led.wasted_rank_rows) == (7, 15, 21, 6)
    assert (led.true_flops, led.padded_flops, led.padding_ratio) == (150, 210, F(7, 5))
    assert adapter_bytes(MIXED_SLOTS, MIXED_RANKS, d_in=3, d_out=2, itemsize=2) == (2 + 3 + 1) * (3 + 2) * 2
    assert rank_ledger([-1, -1], MIXED_RANKS, 3, 3, 2).padding_ratio is None
    with pytest.raises(PlanError) as exc:
        rank_ledger(MIXED_SLOTS, MIXED_RANKS, max_rank=2, d_in=3, d_out=2)
    assert exc.value.code == "E_BANK_RANK_EXCEEDS_R"


def test_mixed_trace_factors_reproduce_the_spec():
    z = [[] if s < 0 else shrink(MIXED_X[i], MIXED_FACTORS[s][0]) for i, s in enumerate(MIXED_SLOTS)]
    assert z == SPEC_Z
    assert exact_delta(MIXED_FACTORS, MIXED_SCALES, MIXED_SLOTS, MIXED_X, 2) == SPEC_D


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", PATHS)
def test_mixed_trace_exact_on_every_path(path, dtype):
    assert torch.equal(run(path, *mixed_case(dtype)), as_f64(plus(MIXED_Y_BASE, SPEC_D)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", PATHS)
def test_mixed_trace_prefill_reorder_keeps_every_row(path, dtype):
    uid = [2, 3, 4, 0, 1, 5, 6, 7]  # scheduler order [p0, p1, d0, d1, d2]: row k is packed row uid[k]
    slots = expand_request_rows([0, 1, 0, -1, 2], [3, 2, 1, 1, 1])
    assert slots.tolist() == [MIXED_SLOTS[u] for u in uid]
    assert contiguous_runs(slots) == ([0, 1, 0, -1, 2], [0, 3, 5, 6, 7, 8])  # a no longer one run
    plan = build_plan(slots)
    validate_plan(plan, slots, num_slots=3)
    assert plan.counts.tolist() == build_plan(torch.tensor(MIXED_SLOTS, dtype=torch.int32)).counts.tolist()
    reordered = mixed_case(dtype, [MIXED_SLOTS[u] for u in uid], [MIXED_X[u] for u in uid],
                           [MIXED_Y_BASE[u] for u in uid])
    out = run(path, *reordered)
    assert torch.equal(out, run(path, *mixed_case(dtype))[uid])
    assert torch.equal(out, as_f64(plus(MIXED_Y_BASE, SPEC_D))[uid])


# ---- the five-row table ------------------------------------------------------------------

FIVE_ADAPTERS = ["A", "A", "B", None, "B"]  # None = __base__
FIVE_SCALE = {"A": F(1, 2), "B": F(3, 2)}
# our choice of inputs and A factors: each adapter's two Z rows form a unimodular matrix
FIVE_X = [[1, 1, 0], [1, 0, 1], [1, 1, 0], None, [1, 0, 0]]
FIVE_A = {"A": [[1, 0, 1], [0, 1, 1]], "B": [[1, 1, 0], [0, 1, -1]]}
SPEC_FIVE_DELTA = [[3, F(3, 2), 0, F(-3, 2)], [F(-1, 2), F(-5, 2), 3, 1], [9, F(9, 2), 0, F(-9, 2)],
                   [0, 0, 0, 0], [6, F(3, 2), 3, F(-3, 2)]]
SPEC_FIVE_Y = [[13, F(3, 2), 1, F(-5, 2)], [F(-1, 2), F(5, 2), 1, 2], [12, F(15, 2), 3, F(-3, 2)],
               [-1, -1, -1, -1], [8, F(11, 2), 9, F(13, 2)]]
FIVE_Y_BASE = [[10, 0, 1, -1], [0, 5, -2, 1], [3, 3, 3, 3], [-1, -1, -1, -1], [2, 4, 6, 8]]


def five_z(name):
    return [shrink(FIVE_X[i], FIVE_A[name]) for i, n in enumerate(FIVE_ADAPTERS) if n == name]


def solve_b(name):
    """B [4, 2] with scale * Z B^T = delta on the adapter's rows: B = (delta / scale)^T Z^-T."""
    z = five_z(name)
    det = z[0][0] * z[1][1] - z[0][1] * z[1][0]
    z_inv = [[z[1][1] / det, -z[0][1] / det], [-z[1][0] / det, z[0][0] / det]]
    d = [[F(v) / FIVE_SCALE[name] for v in SPEC_FIVE_DELTA[i]] for i, n in enumerate(FIVE_ADAPTERS) if n == name]
    return [[sum(z_inv[k][i] * d[i][j] for i in range(2)) for k in range(2)] for j in range(4)]


FIVE_B = {name: solve_b(name) for name in "AB"}


def five_case(dtype, b_slot=0, R=2, scales=FIVE_SCALE):
    order = ["B", "A"] if b_slot == 0 else ["A", "B"]  # b_slot 0 is the spec's vLLM lane, 1 its S-LoRA lane
    slots = [-1 if n is None else order.index(n) for n in FIVE_ADAPTERS]
    factors = [(FIVE_A[n], FIVE_B[n]) for n in order]
    return make_case(factors, [2, 2], [scales[n] for n in order], slots, FIVE_X, FIVE_Y_BASE, R, dtype)


def test_five_row_factors_reproduce_the_spec():
    for name in "AB":
        z = five_z(name)
        assert abs(z[0][0] * z[1][1] - z[0][1] * z[1][0]) == 1
        assert all(v.denominator == 1 for row in FIVE_B[name] for v in row)  # B is integral
    slots = [-1 if n is None else "AB".index(n) for n in FIVE_ADAPTERS]
    factors = [(FIVE_A[n], FIVE_B[n]) for n in "AB"]
    delta = exact_delta(factors, [FIVE_SCALE[n] for n in "AB"], slots, FIVE_X, 4)
    assert delta == SPEC_FIVE_DELTA
    assert plus(FIVE_Y_BASE, delta) == SPEC_FIVE_Y


def test_five_row_plans_of_the_punica_lane_and_a_moved_segment():
    # A first (S-LoRA's compact indices) gives Punica's permutation [0, 1, 2, 4 | 3] and segments [0, 2, 4]
    plan = build_plan(torch.tensor([0, 0, 1, -1, 1], dtype=torch.int32))
    assert plan.sorted_rows.tolist() == [0, 1, 2, 4] and plan.starts.tolist() == [0, 2, 4]
    y, x, a, b, rs, ranks, scales = five_case(torch.float32)
    moved = dataclasses.replace(build_plan(rs), starts=torch.tensor([0, 1, 4], dtype=torch.int32),
                                counts=torch.tensor([1, 3], dtype=torch.int32))
    assert not torch.equal(run("torch", y, x, a, b, rs, ranks, scales, plan=moved), as_f64(SPEC_FIVE_Y))
    with pytest.raises(PlanError) as exc:
        validate_plan(moved, rs, num_slots=2)
    assert exc.value.code == "E_PLAN_SEGMENT_SLOT"


@pytest.mark.parametrize("R", [2, 3])  # R = 3: NaN rank tails that must never be read
@pytest.mark.parametrize("b_slot", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", PATHS)
def test_five_row_table_exact_on_every_path(path, dtype, b_slot, R):
    assert torch.equal(run(path, *five_case(dtype, b_slot, R)), as_f64(SPEC_FIVE_Y))


@pytest.mark.parametrize("path", PATHS)
def test_five_row_one_field_mutations_change_the_output(path):
    expected = as_f64(SPEC_FIVE_Y)
    swapped = five_case(torch.float32, scales={"A": FIVE_SCALE["B"], "B": FIVE_SCALE["A"]})
    assert not torch.equal(run(path, *swapped), expected)
    y, x, a, b, rs, ranks, scales = five_case(torch.float32)
    for row, slot in ((4, 1), (3, 0)):  # one slot; one base-row sentinel
        mutated = rs.clone()
        mutated[row] = slot
        assert not torch.equal(run(path, y, x, a, b, mutated, ranks, scales), expected)
    # zero tails are exact even when the rank comes from the physical R; a stale tail is not
    y, x, a, b, rs, ranks, scales = five_case(torch.float32, R=3)
    a[:, 2], b[:, :, 2] = 0.0, 0.0
    assert torch.equal(run(path, y, x, a, b, rs, None, scales), expected)
    a[0, 2], b[0, :, 2] = 1.0, 1.0
    assert not torch.equal(run(path, y, x, a, b, rs, None, scales), expected)
    assert torch.equal(run(path, y, x, a, b, rs, ranks, scales), expected)  # the true rank never reads it
