"""The Triton three-stage bundle operator: ``add_bundle_slices_triton`` against a float64
oracle, and BundleBank's ``operator="triton"`` against its torch operator."""

import pytest
import torch

from mlora.kernels import build_plan, make_launch_plan
from mlora.kernels.triton_sgmv import add_bundle_slices_triton


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float32 tensor (NaN and -0.0 compare exactly)."""
    return t.contiguous().view(torch.int32)


def _oracle(y0, x, A, B, row_slots, ranks, bank_rows, cores, widths, out_offsets, diag):
    """float64 ``y_t += U_c core_s V_c^T x_t`` per row t of slot s and slice j with ranks[j, s] > 0."""
    y = y0.double().clone()
    for t, s in enumerate(row_slots.tolist()):
        if s < 0:
            continue
        for j, w in enumerate(widths):
            r = int(ranks[j, s])
            if r == 0:
                continue
            c, off = int(bank_rows[j, s]), sum(widths[:j])
            Vt = A[c, j, :r].double()
            U = B[c, off : off + w, :r].double()
            core = torch.diag(cores[s, j, :r].double()) if diag else cores[s, j, :r, :r].double()
            y[t, out_offsets[j] : out_offsets[j] + w] += U @ core @ Vt @ x[t].double()
    return y


def _case(seed, diag, R=6, d_in=40, widths=(24, 8, 16), clusters=(3, 1, 2), S=5, T=13, gap=4):
    """Random bases (NaN in rows past each slice's clusters), slot tables with per-slice
    assignments and unadapted (rank 0) slices whose rows and cores are NaN, rows with base
    rows, and a y whose base rows and column gaps are poisoned."""
    g = torch.Generator().manual_seed(seed)
    n, K = len(widths), max(clusters)
    A = torch.full((K, n, R, d_in), float("nan"))
    B = torch.full((K, sum(widths), R), float("nan"))
    for j, (w, k) in enumerate(zip(widths, clusters)):
        off = sum(widths[:j])
        A[:k, j] = torch.randn(k, R, d_in, generator=g)
        B[:k, off : off + w] = torch.randn(k, w, R, generator=g)
    ranks = torch.where(torch.rand(n, S, generator=g) < 0.25, 0, R).to(torch.int32)
    ranks[:, 0] = R  # slot 0 adapts every slice
    bank_rows = torch.stack([torch.randint(0, k, (S,), generator=g) for k in clusters]).to(torch.int32)
    cores = torch.randn((S, n, R) if diag else (S, n, R, R), generator=g)
    cores[(ranks == 0).t()] = float("nan")  # never read: the slot does not adapt that slice
    bank_rows[ranks == 0] = 99  # never read either
    row_slots = torch.randint(-1, S, (T,), generator=g, dtype=torch.int32)
    row_slots[:2] = torch.tensor([-1, 0])
    out_offsets = [sum(widths[:j]) + j * gap for j in range(n)]
    y0 = torch.randn(T, out_offsets[-1] + widths[-1] + gap, generator=g)
    y0[row_slots < 0] = float("nan")
    y0[0, 0] = -0.0
    x = torch.randn(T, d_in, generator=g)
    return x, y0, A, B, row_slots, ranks, bank_rows, cores, list(widths), out_offsets


@pytest.mark.parametrize("diag", [False, True], ids=["jd-full", "jd-diag"])
@pytest.mark.parametrize("seed,config", [(0, None), (1, {"split": 2}), (2, {"block_r": 16, "group_tiles": 2})])
def test_bundle_kernel_equals_the_float64_oracle(diag, seed, config):
    x, y0, A, B, row_slots, ranks, bank_rows, cores, widths, out_offsets = _case(seed, diag)
    lp = make_launch_plan(build_plan(row_slots))
    y = y0.clone()
    add_bundle_slices_triton(y, x, A, B, lp, ranks, bank_rows, cores, widths, out_offsets, diag=diag, config=config)
    want = _oracle(y0, x, A, B, row_slots, ranks, bank_rows, cores, widths, out_offsets, diag)
    assert torch.equal(_bits(y[row_slots < 0]), _bits(y0[row_slots < 0]))  # base rows, NaN and -0.0 included
    gaps = torch.ones(y.shape[1], dtype=torch.bool)
    for o, w in zip(out_offsets, widths):
        gaps[o : o + w] = False
    assert torch.equal(_bits(y[:, gaps]), _bits(y0[:, gaps]))  # columns no slice owns
    for j, (o, w) in enumerate(zip(out_offsets, widths)):  # unadapted slices: bit-identical
        idle = (row_slots >= 0) & (ranks[j, row_slots.clamp(min=0).long()] == 0)
        assert torch.equal(_bits(y[idle, o : o + w]), _bits(y0[idle, o : o + w]))
    act = row_slots >= 0
    assert not torch.isnan(y[act]).any()  # no NaN bank row, core or rank tail was read
    assert torch.allclose(y[act].double(), want[act], rtol=1e-4, atol=1e-4), float((y[act].double() - want[act]).abs().max())
