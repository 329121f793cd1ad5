"""The gate/up LoRA expand fused with the SiLU product (``mlora.kernels.lora_silu_mul``,
``triton_act``) against the float64 oracle and against the plain path (expand, then the SiLU
kernel), on fresh random inputs with NaN rank tails and a NaN-poisoned output; the Triton
kernel under TRITON_INTERPRET=1 on the CPU (small shapes), compiled on a GPU."""

import pytest
import torch
from test_kernels_reference import TOL
from test_kernels_slices import DEVICE, _dev, sliced_case, sliced_oracle

from mlora.kernels import (
    build_plan,
    empty_launch_plan,
    lora_silu_mul,
    make_launch_plan,
    tile_capacity,
    to_rank_pitched,
)
from mlora.kernels.elementwise import silu_mul_triton
from mlora.kernels.triton_act import lora_silu_mul_triton


def _oracle(y, x, a, b, rs, ranks, scales, widths):
    """float64 silu(gate) * up of the float64 LoRA sums (no intermediate rounding)."""
    gu = sliced_oracle(y, x, a, b, rs, ranks, scales, widths)
    inter = widths[0]
    return torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]


def _case(seed, dtype=torch.float32, **kw):
    kw = dict(dict(T=37, S=4, R=16, d_in=48, widths=(40, 40), base_frac=0.25), **kw)
    return sliced_case(seed, dtype=dtype, **kw)


def _err(got, ref):
    return float((got.cpu().double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("seed, dtype, kw", [
    (0, torch.float32, {}),
    (1, torch.bfloat16, {}),
    (2, torch.float32, dict(base_frac=0.0)),  # every row has an adapter: no base tile has work
    (3, torch.float32, dict(R=40, S=3)),  # ranks up to 40 in a 40-wide bank (a wide z, not a multiple of 16)
    (4, torch.float16, dict(T=70, base_frac=0.6)),
])
@pytest.mark.parametrize("layout", ["padded", "rank-pitched"])
def test_fused_silu_product_matches_the_oracle(backend, seed, dtype, kw, layout):
    """Every row: the LoRA sums' SiLU product (rows with no adapter and slots with rank 0 for
    gate or up included); gate_up left as it was."""
    y, x, a, b, rs, ranks, scales, widths = _case(seed, dtype, **kw)
    ref = _oracle(y, x, a, b, rs, ranks, scales, widths)
    if layout == "rank-pitched":
        b = to_rank_pitched(b, ranks, widths)
    y, x, a, b, rs, ranks, scales = _dev(y, x, a, b, rs, ranks, scales)
    y0 = y.clone()
    out = lora_silu_mul(y, x, a, b, rs, inter=widths[0], ranks=ranks, scales=scales, backend=backend,
                        b_layout=layout)
    assert torch.equal(y, y0)
    assert out.shape == (y.shape[0], widths[0]) and out.dtype == y.dtype
    assert torch.isfinite(out).all()
    assert _err(out, ref) < TOL[dtype] * 2, _err(out, ref)  # one more rounding than the add alone: silu


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("bm", [16, 32])
def test_fused_equals_the_plain_expand_then_the_silu_kernel(bm, group):
    """float32 under the interpreter (IEEE dots, the same tiles): bit for bit the plain path,
    into a NaN-poisoned output; one column tile per program, or groups of three (a ragged
    last group: 40 columns in 16-wide tiles)."""
    y, x, a, b, rs, ranks, scales, widths = _dev(*_case(11, T=45, S=5))
    lp = make_launch_plan(build_plan(rs), bm)
    from mlora.kernels.triton_sgmv import add_lora_slices_triton

    plain = add_lora_slices_triton(y.clone(), x, a, b, lp, ranks, scales, widths, config=dict(block_n=16))
    want = silu_mul_triton(plain, widths[0])
    out = torch.full((y.shape[0], widths[0]), float("nan"), device=y.device)
    lora_silu_mul_triton(y, x, a, b, lp, ranks, scales, widths[0], out=out,
                         config=dict(block_n=16, silu_group_tiles=group))
    if DEVICE == "cpu":
        assert torch.equal(out, want)
    else:  # compiled: the fused kernel's dot may round apart from the expand's
        assert torch.allclose(out, want, rtol=1e-5, atol=1e-5)


def test_static_plan_refilled_with_fewer_base_rows_never_reads_stale_ones():
    """A captured batch size's static plan, filled with many base rows then with few: the
    entries past ``num_base`` are stale (they name rows that now have adapters) and must not
    be written with the base path's value."""
    y, x, a, b, rs, ranks, scales, widths = _case(21, T=33, base_frac=0.7)
    y, x, a, b, rs, ranks, scales = _dev(y, x, a, b, rs, ranks, scales)
    T = y.shape[0]
    static = empty_launch_plan(T, tile_capacity(T, 4, 16), 16, y.device)
    static.fill_from_rows(rs.cpu())
    assert int(static.num_base) == int((rs < 0).sum()) > 20
    rs2 = rs.clone()
    rs2[rs2 < 0] = torch.arange(int((rs2 < 0).sum()), device=rs2.device, dtype=rs2.dtype) % 4
    rs2[:3] = -1  # now three base rows
    static.fill_from_rows(rs2.cpu())
    assert int(static.num_base) == 3
    out = torch.full((T, widths[0]), float("nan"), device=y.device)
    lora_silu_mul_triton(y, x, a, b, static, ranks, scales, widths[0], out=out)
    ref = _oracle(y.cpu(), x.cpu(), a.cpu(), b.cpu(), rs2.cpu(), ranks.cpu(), scales.cpu(), widths)
    assert torch.isfinite(out).all()
    assert _err(out, ref) < TOL[torch.float32] * 2


def test_a_batch_with_no_adapter_rows_is_the_silu_product_alone():
    """No plan tile at all (every row slot-less): the base tiles write every row."""
    y, x, a, b, rs, ranks, scales, widths = _dev(*_case(31))
    rs = torch.full_like(rs, -1)
    lp = make_launch_plan(build_plan(rs))
    assert int(lp.num_tiles) == 0 and int(lp.num_base) == y.shape[0]
    out = torch.full((y.shape[0], widths[0]), float("nan"), device=y.device)
    lora_silu_mul_triton(y, x, a, b, lp, ranks, scales, widths[0], out=out)
    assert torch.equal(out, silu_mul_triton(y, widths[0]))


def test_a_bank_without_two_slices_is_refused():
    y, x, a, b, rs, ranks, scales, widths = _case(41, widths=(24, 8, 8))
    with pytest.raises(Exception, match="E_BANK_SHAPE"):
        lora_silu_mul(y[:, :48], x, a, b, rs, inter=24, ranks=ranks, scales=scales, backend="torch")


def test_launch_plans_list_the_slot_less_rows_in_row_order():
    """``base_rows`` / ``num_base`` of a built plan, after ``to``, and in a static plan refilled
    with fewer of them (the entries past ``num_base`` are never read)."""
    rs = torch.tensor([-1, 2, -1, 0, -1, 2], dtype=torch.int32)
    lp = make_launch_plan(build_plan(rs), 16)
    assert int(lp.num_base) == 3 and lp.base_rows[:3].tolist() == [0, 2, 4]
    assert sorted(lp.base_rows.tolist()) == list(range(6))  # every row once: the others after
    moved = lp.to("cpu")
    assert torch.equal(moved.base_rows, lp.base_rows) and torch.equal(moved.num_base, lp.num_base)
    static = empty_launch_plan(8, tile_capacity(8, 3, 16), 16, "cpu")
    static.fill_from_rows(rs)
    assert int(static.num_base) == 3 and static.base_rows[:3].tolist() == [0, 2, 4]
    static.fill_from_rows(torch.tensor([1, -1, 0, 0], dtype=torch.int32))
    assert int(static.num_base) == 1 and static.base_rows[0].item() == 1
    with pytest.raises(ValueError, match="base rows"):
        empty_launch_plan(3, 4, 16, "cpu").copy_from(lp)  # room for its rows and tiles, not its 6 base rows
