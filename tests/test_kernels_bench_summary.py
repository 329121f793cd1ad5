"""``mlora bench kernels``' verdicts (``mlora.bench.kernels.summarize``): which cases each of
the kernel targets is judged on. Pure bookkeeping over timed cases, so it runs on the CPU
with made-up times. Also the static plan every timed case replays (``captured_plan``)."""

import pytest
import torch

from mlora.bench.kernels import MIXED_CASES, captured_plan, summarize
from mlora.kernels import build_plan, make_launch_plan, tile_capacity


def case(T, adapters, floor_us, graph_us, loop_us=None):
    return dict(T=T, adapters=adapters, floor_s=floor_us * 1e-6, triton_graph_s=graph_us * 1e-6,
                fraction=floor_us / graph_us, correct=True, **({"loop_s": loop_us * 1e-6} if loop_us else {}))


def mixed(ratio, mixed_floor_us, floor_ratio, correct=True):
    return dict(T=0, adapters=0, d_out="4096", ratio=ratio, mixed_floor_s=mixed_floor_us * 1e-6,
                floor_ratio=floor_ratio, padded_floor_s=mixed_floor_us / floor_ratio * 1e-6, correct=correct)


def test_the_targets_split_cases_at_a_10_us_floor():
    cases = [case(1024, 8, 40.0, 80.0), case(4096, 64, 20.0, 25.0),  # fractions 0.5, 0.8
             case(1, 1, 0.5, 11.0), case(256, 64, 6.0, 13.0, loop_us=400.0)]
    s = summarize(cases, [])
    assert (s["floor_ge_10us_cases"], s["launch_bound_cases"]) == (2, 2)
    assert s["fraction_geomean"] == pytest.approx((0.5 * 0.8) ** 0.5)
    assert s["fraction_min"] == pytest.approx(0.5)
    assert s["launch_bound_max_s"] == pytest.approx(13e-6)
    assert s["loop_speedup_min"] == pytest.approx(400 / 13)
    t = s["targets"]
    assert t["fraction_geomean_ge_0_4"] and t["fraction_min_ge_0_15"] and t["loop_speedup_ge_10x"]
    assert not t["launch_bound_le_12us"]  # 13 us > 12
    assert not t["mixed_le_0_6_padded"] and not t["mixed_le_0_6_padded_where_attainable"]  # no mixed case: not met


def test_mixed_rank_target_literal_and_where_attainable():
    """The literal target takes the worst mixed case; the attainable one skips mixed batches
    that are launch-bound (own floor < 10 us) or whose floor ratio is above 0.6 (no kernel
    could reach 0.6x there), and is judged on the rest."""
    ms = [mixed(0.90, 5.0, 0.45),    # launch-bound mixed batch
          mixed(0.91, 31.0, 0.78),   # x and y outweigh the factors
          mixed(0.55, 45.0, 0.46), mixed(0.58, 80.0, 0.51)]
    s = summarize([case(1024, 8, 40.0, 80.0)], ms)
    assert s["mixed_ratio_max"] == pytest.approx(0.91)
    assert s["mixed_ratio_max_attainable"] == pytest.approx(0.58)
    assert not s["targets"]["mixed_le_0_6_padded"]
    assert s["targets"]["mixed_le_0_6_padded_where_attainable"]
    ms[3] = mixed(0.62, 80.0, 0.51)
    assert not summarize([case(1024, 8, 40.0, 80.0)], ms)["targets"]["mixed_le_0_6_padded_where_attainable"]
    bad = summarize([case(1024, 8, 40.0, 80.0)], ms[:2] + [mixed(0.5, 45.0, 0.46, correct=False)])
    assert not bad["all_correct"]


def test_the_mixed_grid_has_factor_bound_cases():
    """At least one mixed case with many adapters of the wide output, where the factors' bytes
    dominate (the cases the attainable verdict is judged on)."""
    assert (256, 256, "14336") in MIXED_CASES and (1024, 256, "14336") in MIXED_CASES


@pytest.mark.parametrize("T, A, block_m", [(256, 64, None), (300, 8, 32), (5, 2, None)])
def test_captured_plan_holds_the_plan_in_buffers_sized_for_the_batch(T, A, block_m):
    """The plan's tiles and base rows, copied into buffers of the capacity the engine gives a
    captured batch of T rows over A slots (more tiles than the plan has: the rest invalid)."""
    rs = torch.randint(-1, A, (T,), dtype=torch.int32, generator=torch.Generator().manual_seed(T))
    lp = make_launch_plan(build_plan(rs), block_m)
    got = captured_plan(build_plan(rs), A, block_m)
    assert (got.block_m, got.row_capacity) == (lp.block_m, T)
    assert got.tile_capacity == tile_capacity(T, A, lp.block_m) >= lp.tile_capacity
    n = lp.tile_capacity
    for f in ("tile_slot", "tile_start", "tile_end"):
        assert torch.equal(getattr(got, f)[:n], getattr(lp, f)), f
    for f in ("sorted_rows", "num_tiles", "base_rows", "num_base"):
        assert torch.equal(getattr(got, f)[: getattr(lp, f).numel()], getattr(lp, f)), f
