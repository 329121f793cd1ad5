"""SegmentPlan and the torch reference paths of add_lora (docs/design.md, Segment plan).

The spec's 8-row fixed-rank trace first, then fresh random inputs against the
float64 oracle with poisoned outputs and NaN rank tails, then one-field
malformed plans and banks with their error codes.
"""

import dataclasses
from fractions import Fraction

import pytest
import torch

from mlora.kernels import (
    PlanError,
    add_lora,
    build_plan,
    lora_gather_bmm,
    lora_loop,
    lora_oracle_f64,
    validate_plan,
)

# ---- the exact 8-row trace ------------------------------------------------------

ADAPTER_IDS = [1, 2, 1, 0, 2, 2, 1, 0]  # 0 = base only; adapter k lives in slot k - 1
ROW_SLOTS = torch.tensor([a - 1 for a in ADAPTER_IDS], dtype=torch.int32)
X_ACTIVE = {0: [1, 0, 1, 0], 2: [1, 1, 0, 0], 6: [1, 1, 1, 1], 1: [0, 1, 0, 1], 4: [0, 1, 1, 0], 5: [1, 0, 0, 1]}
A = [[[1, 0, 1, 0], [0, 1, 0, 1]], [[1, 1, 0, 0], [0, 0, 1, 1]]]
B = [[[1, 0], [0, 1], [1, 1]], [[1, 1], [1, -1], [0, 1]]]
SCALES = [0.5, 2.0]
F = Fraction
DELTA = [[1, 0, 1], [4, 0, 2], [F(1, 2), F(1, 2), 1], [0, 0, 0], [4, 0, 2], [4, 0, 2], [1, 1, 2], [0, 0, 0]]
Y_FINAL = [[2, 1, 2], [5, 1, 3], [F(3, 2), F(3, 2), 3], [3, 0, 2], [4, 2, 3], [6, 0, 3], [3, 3, 4], [1, 2, 0]]


def spec_inputs(dtype):
    # rows 3 and 7 are base only: their inputs must not matter, so they are NaN
    x = torch.full((8, 4), float("nan"), dtype=dtype)
    for row, v in X_ACTIVE.items():
        x[row] = torch.tensor(v, dtype=dtype)
    y_base = torch.tensor([[float(Y_FINAL[i][j] - DELTA[i][j]) for j in range(3)] for i in range(8)], dtype=dtype)
    return x, y_base, torch.tensor(A, dtype=dtype), torch.tensor(B, dtype=dtype), torch.tensor(SCALES)


def test_spec_plan_metadata():
    plan = build_plan(ROW_SLOTS)
    assert plan.sorted_rows.tolist() == [0, 2, 6, 1, 4, 5]
    assert plan.slot_ids.tolist() == [0, 1]
    assert plan.starts.tolist() == [0, 3, 6]
    assert plan.counts.tolist() == [3, 3]
    validate_plan(plan, ROW_SLOTS, num_slots=2)


# add_lora takes bf16/fp16/fp32 only (float64 is refused: test_malformed_bank_is_named)
SPEC_CASES = [(p, d) for p in ("oracle", "loop", "gather_bmm", "add_lora")
              for d in (torch.float32, torch.float64, torch.bfloat16) if not (p == "add_lora" and d == torch.float64)]


@pytest.mark.parametrize("path, dtype", SPEC_CASES)
def test_spec_trace_exact(path, dtype):
    x, y, a, b, s = spec_inputs(dtype)
    if path == "oracle":
        out = lora_oracle_f64(y, x, a, b, ROW_SLOTS, scales=s)
    else:
        fn = {"loop": lora_loop, "gather_bmm": lora_gather_bmm}.get(path)
        out = fn(y, x, a, b, ROW_SLOTS, None, s) if fn else add_lora(y, x, a, b, ROW_SLOTS, scales=s)
        assert out is y  # in place
    expected = torch.tensor([[float(v) for v in row] for row in Y_FINAL], dtype=torch.float64)
    assert torch.equal(out.to(torch.float64), expected)  # every value is exact in bf16


# ---- property tests on fresh random inputs ------------------------------------------


def random_case(seed, T=37, S=5, R=16, d_in=24, d_out=20, dtype=torch.float32, base_frac=0.25):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d_in, generator=g).to(dtype)
    a = torch.randn(S, R, d_in, generator=g).to(dtype)
    b = torch.randn(S, d_out, R, generator=g).to(dtype)
    ranks = torch.randint(1, R + 1, (S,), generator=g, dtype=torch.int32)
    ranks[0] = R
    for s in range(S):  # poison the padded tails: they must never be read
        a[s, ranks[s]:] = float("nan")
        b[s, :, ranks[s]:] = float("nan")
    scales = torch.rand(S, generator=g) * 2 + 0.1
    row_slots = torch.randint(0, S, (T,), generator=g, dtype=torch.int32)
    row_slots[torch.rand(T, generator=g) < base_frac] = -1
    y = torch.randn(T, d_out, generator=g).to(dtype) * 3  # poisoned output: nonzero before the call
    return y, x, a, b, row_slots, ranks, scales


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["loop", "gather_bmm", "add_lora"])
def test_paths_match_the_oracle(seed, dtype, path):
    y, x, a, b, rs, ranks, scales = random_case(seed, dtype=dtype)
    ref = lora_oracle_f64(y, x, a, b, rs, ranks, scales)
    y0 = y.clone()
    if path == "add_lora":
        out = add_lora(y, x, a, b, rs, ranks=ranks, scales=scales, backend="torch")
    else:
        out = {"loop": lora_loop, "gather_bmm": lora_gather_bmm}[path](y, x, a, b, rs, ranks, scales)
    assert torch.isfinite(out).all()  # NaN tails never reached the output
    base = rs < 0
    assert torch.equal(out[base], y0[base])  # base-only rows bit-identical
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[dtype], float(err)


def test_reordering_rows_gives_the_same_per_row_result():
    y, x, a, b, rs, ranks, scales = random_case(11)
    out = add_lora(y.clone(), x, a, b, rs, ranks=ranks, scales=scales)
    perm = torch.randperm(rs.numel(), generator=torch.Generator().manual_seed(3))
    out_p = add_lora(y[perm].clone(), x[perm], a, b, rs[perm], ranks=ranks, scales=scales)
    torch.testing.assert_close(out_p, out[perm], rtol=1e-6, atol=1e-6)


def test_all_base_rows_and_empty_batch():
    y, x, a, b, rs, ranks, scales = random_case(2)
    rs[:] = -1
    y0 = y.clone()
    assert torch.equal(add_lora(y, x, a, b, rs, ranks=ranks, scales=scales), y0)
    empty = add_lora(y[:0], x[:0], a, b, rs[:0], ranks=ranks, scales=scales)
    assert empty.shape == (0, y.shape[1])


def test_rank_zero_slot_adds_nothing():
    y, x, a, b, rs, ranks, scales = random_case(5)
    ranks[1] = 0
    a[1] = float("nan")
    b[1] = float("nan")
    y0 = y.clone()
    out = add_lora(y, x, a, b, rs, ranks=ranks, scales=scales)
    assert torch.equal(out[rs == 1], y0[rs == 1])


def test_unknown_backend_is_refused():
    y, x, a, b, rs, ranks, scales = random_case(1)
    with pytest.raises(ValueError):
        add_lora(y, x, a, b, rs, ranks=ranks, scales=scales, backend="cutlass")


# ---- malformed plans and banks: one field each -------------------------------------


def _mutated(plan, **fields):
    return dataclasses.replace(plan, **fields)


@pytest.mark.parametrize(
    "mutate, code",
    [
        (lambda p: _mutated(p, sorted_rows=torch.tensor([0, 2, 2, 1, 4, 5], dtype=torch.int32)), "E_PLAN_DUPLICATE_ROW"),
        (lambda p: _mutated(p, sorted_rows=torch.tensor([0, 2, 6, 1, 4, 3], dtype=torch.int32)), "E_PLAN_BASE_ROW"),
        (lambda p: _mutated(p, sorted_rows=torch.tensor([0, 2, 6, 1, 4], dtype=torch.int32)), "E_PLAN_MISSING_ROW"),
        (lambda p: _mutated(p, sorted_rows=torch.tensor([0, 2, 6, 1, 4, 8], dtype=torch.int32)), "E_PLAN_ROW_BOUNDS"),
        (lambda p: _mutated(p, sorted_rows=torch.tensor([0, 2, 1, 6, 4, 5], dtype=torch.int32)), "E_PLAN_SEGMENT_SLOT"),
        (lambda p: _mutated(p, sorted_rows=torch.tensor([2, 0, 6, 1, 4, 5], dtype=torch.int32)), "E_PLAN_UNSTABLE"),
        (lambda p: _mutated(p, starts=torch.tensor([0, 3, 5], dtype=torch.int32)), "E_PLAN_OFFSETS"),
        (lambda p: _mutated(p, starts=torch.tensor([0, 2, 6], dtype=torch.int32)), "E_PLAN_COUNTS"),
        (lambda p: _mutated(p, counts=torch.tensor([3, 2], dtype=torch.int32)), "E_PLAN_COUNTS"),
        (lambda p: _mutated(p, slot_ids=torch.tensor([0, 1, 1], dtype=torch.int32)), "E_PLAN_LENGTHS"),
        (lambda p: _mutated(p, slot_ids=torch.tensor([0, 7], dtype=torch.int32)), "E_PLAN_SLOT_RANGE"),
        (lambda p: _mutated(p, slot_ids=torch.tensor([1, 0], dtype=torch.int32)), "E_PLAN_SEGMENT_ORDER"),
        (lambda p: _mutated(p, num_rows=9), "E_PLAN_ROWS"),
        (lambda p: _mutated(p, max_count=4), "E_PLAN_COUNTS"),
        (lambda p: _mutated(p, generation=3), "E_PLAN_GENERATION"),
    ],
)
def test_malformed_plan_is_named(mutate, code):
    plan = mutate(build_plan(ROW_SLOTS))
    with pytest.raises(PlanError) as exc:
        validate_plan(plan, ROW_SLOTS, num_slots=2, expected_generation=0)
    assert exc.value.code == code


def test_rank_table_checked_against_R():
    plan = build_plan(ROW_SLOTS)
    with pytest.raises(PlanError) as exc:
        validate_plan(plan, ROW_SLOTS, num_slots=2, ranks=torch.tensor([2, 3]), max_rank=2)
    assert exc.value.code == "E_BANK_RANK_EXCEEDS_R"


@pytest.mark.parametrize(
    "change, code",
    [
        (lambda c: c.update(ranks=torch.tensor([17, 1, 1, 1, 1], dtype=torch.int32)), "E_BANK_RANK_EXCEEDS_R"),
        (lambda c: c.update(b=c["b"][:, :, :8]), "E_BANK_SHAPE"),
        (lambda c: c.update(x=c["x"][:, :5]), "E_BANK_SHAPE"),
        (lambda c: c.update(rs=c["rs"][:5]), "E_BANK_SHAPE"),
        (lambda c: c.update(b=c["b"].half()), "E_BANK_DTYPE"),
        (lambda c: c.update(x=c["x"].double()), "E_BANK_DTYPE"),
        (lambda c: c.update(rs=torch.full_like(c["rs"], 5)), "E_PLAN_SLOT_RANGE"),
        (lambda c: c.update(scales=c["scales"][:2]), "E_BANK_SHAPE"),
    ],
)
def test_malformed_bank_is_named(change, code):
    y, x, a, b, rs, ranks, scales = random_case(0)
    c = dict(y=y, x=x, a=a, b=b, rs=rs, ranks=ranks, scales=scales)
    change(c)
    with pytest.raises(PlanError) as exc:
        add_lora(c["y"], c["x"], c["a"], c["b"], c["rs"], ranks=c["ranks"], scales=c["scales"])
    assert exc.value.code == code


def test_host_plans_are_built_on_one_thread(monkeypatch):
    """build_plan and make_launch_plan on host tensors run their torch ops with one intra-op
    thread (plan.serial_on_host: a descheduled worker thread stalled each op of an 8,192-row
    plan for a time slice on a busy machine) and restore the caller's count, also on error;
    the plans equal those built with the caller's threads."""
    import mlora.kernels.launch as launch_mod
    import mlora.kernels.plan as plan_mod
    from mlora.kernels import make_launch_plan

    original = torch.get_num_threads()
    torch.set_num_threads(max(2, original))  # a caller with more than one thread
    try:
        _check_serial_plans(monkeypatch, plan_mod, launch_mod, make_launch_plan)
    finally:
        torch.set_num_threads(original)


def _check_serial_plans(monkeypatch, plan_mod, launch_mod, make_launch_plan):
    before = torch.get_num_threads()
    rs = torch.randint(-1, 9, (8192,), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    seen = []
    real_group, real_tiles = plan_mod._group, launch_mod._tiles
    monkeypatch.setattr(plan_mod, "_group", lambda *a: (seen.append(torch.get_num_threads()), real_group(*a))[1])
    monkeypatch.setattr(launch_mod, "_tiles", lambda *a: (seen.append(torch.get_num_threads()), real_tiles(*a))[1])
    plan = build_plan(rs)
    lp = make_launch_plan(plan)
    assert seen == [1, 1] and torch.get_num_threads() == before
    want_plan = real_group(rs, 0)
    want_lp = real_tiles(want_plan, None)
    for f in ("sorted_rows", "slot_ids", "counts", "starts"):
        assert torch.equal(getattr(plan, f), getattr(want_plan, f)), f
    for f in ("sorted_rows", "tile_slot", "tile_start", "tile_end", "num_tiles", "base_rows", "num_base"):
        assert torch.equal(getattr(lp, f), getattr(want_lp, f)), f
    monkeypatch.setattr(plan_mod, "_group", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        build_plan(rs)
    assert torch.get_num_threads() == before
