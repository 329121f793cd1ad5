"""Fused multi-slice calls, the LaunchPlan tile list, split-K and CUDA-graph capture.

Every backend is compared with a per-slice float64 oracle on fresh random
inputs with poisoned outputs and NaN rank tails. On the CPU the Triton
kernels run under TRITON_INTERPRET=1 (small shapes); on a GPU the same tests
run compiled, and the graph-capture test runs too.
"""

import pytest
import torch
from test_kernels_reference import TOL

from mlora.kernels import (
    PlanError,
    add_lora_slices,
    build_plan,
    empty_launch_plan,
    lora_oracle_f64,
    make_launch_plan,
    tile_capacity,
)
from mlora.kernels.triton_sgmv import launch_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sliced_case(seed, T=29, S=4, R=16, d_in=32, widths=(24, 8, 8), dtype=torch.float32, base_frac=0.2):
    g = torch.Generator().manual_seed(seed)
    n = len(widths)
    x = torch.randn(T, d_in, generator=g).to(dtype)
    a = torch.randn(S, n, R, d_in, generator=g).to(dtype)
    b = torch.randn(S, sum(widths), R, generator=g).to(dtype)
    ranks = torch.randint(0, R + 1, (n, S), generator=g, dtype=torch.int32)
    ranks[0, 0] = R
    if n > 1:
        ranks[1, 1] = 0  # slot 1 does not target slice 1 (as an adapter without k_proj)
    poison_rank_tails(a, b, ranks, widths)
    scales = torch.rand(n, S, generator=g) * 2 + 0.1
    rs = torch.randint(0, S, (T,), generator=g, dtype=torch.int32)
    rs[torch.rand(T, generator=g) < base_frac] = -1
    y = torch.randn(T, sum(widths), generator=g).to(dtype) * 3
    return y, x, a, b, rs, ranks, scales, list(widths)


def poison_rank_tails(a, b, ranks, widths):
    """NaN in every factor entry past its slot's true rank (A [S, n, R, d_in], B [S, sum(w), R])."""
    off = [0]
    for w in widths:
        off.append(off[-1] + w)
    for j in range(len(widths)):
        for s in range(a.shape[0]):
            a[s, j, ranks[j, s]:] = float("nan")
            b[s, off[j] : off[j + 1], ranks[j, s]:] = float("nan")


def mixed_rank_case(seed, T, ranks_by_slice, widths=(32, 16)):
    """sliced_case in a rank-64 bank whose slots have the given true ranks per slice: fresh
    factors, NaN past each rank."""
    S = len(ranks_by_slice[0])
    case = sliced_case(seed, T=T, S=S, R=64, d_in=48, widths=widths, dtype=torch.float32, base_frac=0.1)
    y, x, a, b, rs, ranks, scales, widths = case
    ranks[:] = torch.tensor(ranks_by_slice, dtype=torch.int32)
    a.normal_()
    b.normal_()
    poison_rank_tails(a, b, ranks, widths)
    return y, x, a, b, rs, ranks, scales, widths


def sliced_oracle(y, x, a, b, rs, ranks, scales, widths):
    """Per-slice float64 oracle: slice j is the one-slice contract on its column block."""
    out = y.double().clone()
    off = 0
    for j, w in enumerate(widths):
        out[:, off : off + w] = lora_oracle_f64(y[:, off : off + w], x, a[:, j], b[:, off : off + w], rs, ranks[j], scales[j])
        off += w
    return out


def _dev(*ts):
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in ts]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    "seed, dtype, shape",
    [
        (0, torch.float32, {}),
        (1, torch.bfloat16, {}),
        (2, torch.float16, dict(widths=(16, 40))),  # gate/up-like, unequal widths
        (3, torch.float32, dict(T=5, S=5, widths=(20,), base_frac=0.0)),  # one slice, one row per slot
        (4, torch.float32, dict(widths=(8, 16, 8, 24, 8, 16))),  # more slices than one launch pair takes
    ],
)
def test_slices_match_the_oracle(backend, seed, dtype, shape):
    case = sliced_case(seed, dtype=dtype, **shape)
    ref = sliced_oracle(*case)
    y, x, a, b, rs, ranks, scales, widths = _dev(*case)
    y0 = y.clone()
    out = add_lora_slices(y, x, a, b, rs, widths=widths, ranks=ranks, scales=scales, backend=backend)
    assert out is y
    assert torch.isfinite(out).all()  # NaN tails never read
    assert torch.equal(out[rs < 0], y0[rs < 0])  # base-only rows bit-identical
    # slice 1 of slot 1 has rank 0: those columns are exactly untouched
    w0, w1 = widths[0], widths[1] if len(widths) > 1 else 0
    assert torch.equal(out[rs == 1, w0 : w0 + w1], y0[rs == 1, w0 : w0 + w1])
    err = (out.cpu().double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[dtype], float(err)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("widths, out_offsets, y_width", [
    ((24, 8), (0, 32), 40),  # q and v of a q/k/v projection: the k columns [24, 32) are not the bank's
    ((8, 16, 8, 24, 8), (3, 11, 40, 48, 80), 96),  # gaps everywhere, more slices than one launch pair
])
def test_slices_at_out_offsets_leave_other_columns_untouched(backend, widths, out_offsets, y_width):
    """A bank holding some slices of a fused projection adds into the full output at each
    slice's own columns (``out_offsets``); every column no slice owns is bit-identical."""
    y_bank, x, a, b, rs, ranks, scales, widths = sliced_case(21, widths=widths)
    ref_bank = sliced_oracle(y_bank, x, a, b, rs, ranks, scales, widths)
    g = torch.Generator().manual_seed(22)
    y = torch.randn(y_bank.shape[0], y_width, generator=g) * 3
    owned = torch.zeros(y_width, dtype=torch.bool)
    off = 0
    for o, w in zip(out_offsets, widths):
        y[:, o : o + w] = y_bank[:, off : off + w]
        owned[o : o + w] = True
        off += w
    ref = y.double().clone()
    off = 0
    for o, w in zip(out_offsets, widths):
        ref[:, o : o + w] = ref_bank[:, off : off + w]
        off += w
    yd, xd, ad, bd, rsd, ranksd, scalesd = _dev(y, x, a, b, rs, ranks, scales)
    y0 = yd.clone()
    add_lora_slices(yd, xd, ad, bd, rsd, widths=widths, ranks=ranksd, scales=scalesd, backend=backend,
                    out_offsets=out_offsets)
    assert torch.equal(yd[:, ~owned.to(yd.device)], y0[:, ~owned.to(yd.device)])
    assert torch.equal(yd[rsd < 0], y0[rsd < 0])
    err = (yd.cpu().double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[torch.float32], float(err)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strided_rank_and_scale_tables(backend):
    """Ranks and scales as a layer's view of slot-major [S, L, n] tables (strides (1, L*n)),
    as the banks pass them: the same result as contiguous [n, S] tables."""
    y, x, a, b, rs, ranks, scales, widths = sliced_case(24, widths=(24, 8, 8))
    n, S = ranks.shape
    L, layer = 3, 1
    big_r = torch.randint(0, 5, (S, L, n), dtype=torch.int32)
    big_s = torch.rand(S, L, n) + 7  # other layers' entries: wrong values if ever read
    big_r[:, layer] = ranks.t()
    big_s[:, layer] = scales.t()
    yd, xd, ad, bd, rsd = _dev(y, x, a, b, rs)
    want = yd.clone()
    add_lora_slices(want, xd, ad, bd, rsd, widths=widths, ranks=ranks.to(DEVICE), scales=scales.to(DEVICE),
                    backend=backend)
    r_view, s_view = big_r.to(DEVICE)[:, layer].t(), big_s.to(DEVICE)[:, layer].t()
    assert not r_view.is_contiguous() and r_view.stride() == s_view.stride()
    got = yd.clone()
    add_lora_slices(got, xd, ad, bd, rsd, widths=widths, ranks=r_view, scales=s_view, backend=backend)
    assert torch.equal(got, want)


@pytest.mark.parametrize("out_offsets, y_width", [((0, 20), 40), ((8, 0), 40), ((0, 32), 39), ((-1, 32), 40),
                                                  ((0,), 40)])
def test_bad_out_offsets_are_rejected(out_offsets, y_width):
    y, x, a, b, rs, ranks, scales, widths = sliced_case(23, widths=(24, 8))
    y = torch.zeros(y.shape[0], y_width)
    with pytest.raises(PlanError) as e:
        add_lora_slices(y, x, a, b, rs, widths=widths, ranks=ranks, scales=scales, backend="torch",
                        out_offsets=out_offsets)
    assert e.value.code == "E_BANK_SHAPE"


def test_tile_list_covers_every_active_row_once():
    g = torch.Generator().manual_seed(4)
    rs = torch.randint(-1, 6, (100,), generator=g, dtype=torch.int32)
    plan = build_plan(rs)
    for bm in (16, 32, 64):
        lp = make_launch_plan(plan, bm)
        n = int(lp.num_tiles)
        assert n <= lp.tile_capacity <= tile_capacity(100, 7, bm)
        covered = []
        for i in range(n):
            u0, u1, slot = int(lp.tile_start[i]), int(lp.tile_end[i]), int(lp.tile_slot[i])
            rows = lp.sorted_rows[u0 : min(u0 + bm, u1)].long()
            assert (rs[rows] == slot).all()
            covered += rows.tolist()
        assert sorted(covered) == torch.nonzero(rs >= 0).flatten().tolist()
        assert (lp.tile_slot[n:] == -1).all()


def test_split_k_path_matches_the_oracle():
    # decode-like: few rows per slot and a d_in long enough to split
    # (2,048: on a GPU each split walks at least 8 K-blocks of 128)
    case = sliced_case(6, T=3, S=3, R=16, d_in=2048, widths=(16,), base_frac=0.0)
    cfg = launch_config(make_launch_plan(build_plan(case[4])).tile_capacity, 1, 16, 2048, [16], torch.device(DEVICE), False)
    assert cfg["split"] > 1  # this test must keep covering split-K
    ref = sliced_oracle(*case)
    y, x, a, b, rs, ranks, scales, widths = _dev(*case)
    y0 = y.clone()
    add_lora_slices(y, x, a, b, rs, widths=widths, ranks=ranks, scales=scales, backend="triton")
    err = (y.cpu().double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[torch.float32], float(err)
    # the last split to arrive summed the partials and reset its counter: a second
    # call starts from zeroed counters and gives bit-identical output (fixed order)
    from mlora.kernels.triton_sgmv import _COUNTERS

    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS[str(y.device)])
    y2 = y0.clone()
    add_lora_slices(y2, x, a, b, rs, widths=widths, ranks=ranks, scales=scales, backend="triton")
    assert torch.equal(y2, y)


@pytest.mark.parametrize("split,chunk", [(11, 4), (6, 8), (11, 1)])
def test_split_partials_summed_in_chunks_match_the_oracle(split, chunk):
    """The last split sums the partials in chunks of ``sum_chunk`` loaded together: a split that
    is not a multiple of the chunk (a masked tail chunk), one smaller than a chunk, and chunks
    of one. Same result on a second call (fixed summation order)."""
    from mlora.kernels.triton_sgmv import add_lora_slices_triton

    case = sliced_case(12, T=5, S=3, R=16, d_in=352, widths=(24, 8), base_frac=0.2)
    ref = sliced_oracle(*case)
    y, x, a, b, rs, ranks, scales, widths = _dev(*case)
    y0 = y.clone()
    lp = make_launch_plan(build_plan(rs), 16)
    config = dict(split=split, sum_chunk=chunk, block_k=32)  # the CUDA default (128) would allow only 3 splits of 352
    cfg = launch_config(lp.tile_capacity, 2, 16, 352, list(widths), torch.device(DEVICE), False, 16, **config)
    assert (cfg["split"], cfg["sum_chunk"]) == (split, chunk)  # the case really takes this many partials
    add_lora_slices_triton(y, x, a, b, lp, ranks, scales, widths, config=config)
    assert torch.equal(y[rs < 0], y0[rs < 0])
    err = (y.cpu().double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[torch.float32], float(err)
    y2 = y0.clone()
    add_lora_slices_triton(y2, x, a, b, lp, ranks, scales, widths, config=config)
    assert torch.equal(y2, y)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_layer_view_of_a_slot_major_bank_matches_the_oracle(backend):
    """The engine's banks are slot-major ([S, L, ...]: one slot's factors contiguous, so a load is
    one plain copy); a layer's factors are then a view strided over slots. Same result as the
    contiguous bank, layer by layer, other layers' poison never read."""
    L = 3
    case = list(sliced_case(13, T=17, S=4, R=16, d_in=48, widths=(24, 8, 8), base_frac=0.2))
    y, x, a, b, rs, ranks, scales, widths = case
    ref = sliced_oracle(*case)
    big_a = torch.full((a.shape[0], L) + tuple(a.shape[1:]), float("nan"), dtype=a.dtype)
    big_b = torch.full((b.shape[0], L) + tuple(b.shape[1:]), float("nan"), dtype=b.dtype)
    big_a[:, 1], big_b[:, 1] = a, b
    y, x, big_a, big_b, rs, ranks, scales = _dev(y, x, big_a, big_b, rs, ranks, scales)
    la, lb = big_a[:, 1], big_b[:, 1]
    assert not la.is_contiguous() and la.stride(0) == L * la[0].numel()
    y0 = y.clone()
    add_lora_slices(y, x, la, lb, rs, widths=widths, ranks=ranks, scales=scales, backend=backend)
    assert torch.equal(y[rs < 0], y0[rs < 0])
    err = (y.cpu().double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[torch.float32], float(err)


def test_static_launch_buffers_give_the_same_result():
    """The graph path: a plan copied into larger static buffers, values unchecked."""
    case = sliced_case(7)
    y, x, a, b, rs, ranks, scales, widths = _dev(*case)
    plan = make_launch_plan(build_plan(rs), 16)
    static = empty_launch_plan(64, tile_capacity(64, 4, 16), 16, DEVICE)
    static.copy_from(plan)
    out1 = add_lora_slices(y.clone(), x, a, b, rs, widths=widths, ranks=ranks, scales=scales, backend="triton", plan=plan)
    out2 = add_lora_slices(y.clone(), x, a, b, rs, widths=widths, ranks=ranks, scales=scales, backend="triton",
                           plan=static, check_values=False)
    assert torch.equal(out1, out2)
    with pytest.raises(ValueError):
        empty_launch_plan(4, 1, 16, DEVICE).copy_from(plan)


def test_stale_tiles_past_the_count_are_never_run():
    """Static buffers keep the tiles of an earlier, larger plan past ``num_tiles``:
    the kernels must stop at the count (rows outside the new plan stay bit-identical)."""
    case = sliced_case(11, T=40, S=4, base_frac=0.0)
    y, x, a, b, rs, ranks, scales, widths = _dev(*case)
    static = empty_launch_plan(40, tile_capacity(40, 4, 16), 16, DEVICE)
    static.copy_from(make_launch_plan(build_plan(rs), 16))  # every row active, many tiles
    rs_small = torch.full_like(rs, -1)
    rs_small[3] = 2
    rs_small[17] = 0
    small = make_launch_plan(build_plan(rs_small), 16)
    static.copy_from(small)
    assert int(static.num_tiles) < int((static.tile_slot >= 0).sum())  # stale tiles really are there
    y0 = y.clone()
    add_lora_slices(y, x, a, b, rs_small, widths=widths, ranks=ranks, scales=scales, backend="triton",
                    plan=static, check_values=False)
    assert torch.equal(y[rs_small < 0], y0[rs_small < 0])
    ref = sliced_oracle(*[t.cpu() if isinstance(t, torch.Tensor) else t for t in (y0, x, a, b, rs_small, ranks, scales)],
                        widths)
    err = (y.cpu().double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[torch.float32], float(err)


@pytest.mark.parametrize(
    "change, code",
    [
        (lambda c: c.update(widths=[24, 8]), "E_BANK_SHAPE"),
        (lambda c: c.update(widths=[24, 8, 9]), "E_BANK_SHAPE"),
        (lambda c: c.update(ranks=c["ranks"][0]), "E_BANK_SHAPE"),
        (lambda c: c.update(scales=c["scales"].T), "E_BANK_SHAPE"),
        (lambda c: c.update(ranks=c["ranks"] + 17), "E_BANK_RANK_EXCEEDS_R"),
        (lambda c: c.update(a=c["a"][:, :, :, :5]), "E_BANK_SHAPE"),
    ],
)
def test_malformed_sliced_bank_is_named(change, code):
    y, x, a, b, rs, ranks, scales, widths = sliced_case(0)
    c = dict(y=y, x=x, a=a, b=b, rs=rs, ranks=ranks, scales=scales, widths=widths)
    change(c)
    with pytest.raises(PlanError) as exc:
        add_lora_slices(c["y"], c["x"], c["a"], c["b"], c["rs"], widths=c["widths"], ranks=c["ranks"], scales=c["scales"])
    assert exc.value.code == code


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU (runs on the device)")
def test_cuda_graph_replay_follows_the_static_plan():
    T, S = 48, 6
    case = sliced_case(8, T=T, S=S, dtype=torch.bfloat16, base_frac=0.1)
    y, x, a, b, rs, ranks, scales, widths = _dev(*case)
    static = empty_launch_plan(T, tile_capacity(T, S, 16), 16, DEVICE)
    y_static = y.clone()
    kw = dict(widths=widths, ranks=ranks, scales=scales, backend="triton", plan=static, check_values=False)
    static.copy_from(make_launch_plan(build_plan(rs), 16))
    add_lora_slices(y_static, x, a, b, rs, **kw)  # warm-up: compile, cache metadata
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add_lora_slices(y_static, x, a, b, rs, **kw)
    for seed in range(3):  # new row assignments each step, same graph
        rs_new = torch.randint(-1, S, (T,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32).to(DEVICE)
        static.copy_from(make_launch_plan(build_plan(rs_new), 16))
        y_static.copy_(y)
        graph.replay()
        ref = sliced_oracle(y.cpu(), x.cpu(), a.cpu(), b.cpu(), rs_new.cpu(), ranks.cpu(), scales.cpu(), widths)
        torch.cuda.synchronize()
        assert torch.equal(y_static[rs_new < 0], y[rs_new < 0])
        err = (y_static.cpu().double() - ref).abs().max() / ref.abs().max()
        assert err < TOL[torch.bfloat16], float(err)


@pytest.mark.parametrize("bm", [16, 32, 64])
@pytest.mark.parametrize("config", [dict(group_tiles=3, block_n=16), dict(split=3, group_tiles=2, block_n=16)])
def test_column_groups_and_forced_split_match_the_oracle(config, bm):
    """Expand programs streaming several column tiles (incl. a ragged last group), in row
    tiles of 16, 32 and 64."""
    from mlora.kernels.triton_sgmv import add_lora_slices_triton

    case = sliced_case(9, T=21, S=3, d_in=96, widths=(40, 24, 56))
    ref = sliced_oracle(*case)
    y, x, a, b, rs, ranks, scales, widths = _dev(*case)
    y0 = y.clone()
    lp = make_launch_plan(build_plan(rs), bm)
    add_lora_slices_triton(y, x, a, b, lp, ranks, scales, widths, config=config)
    assert torch.equal(y[rs < 0], y0[rs < 0])
    err = (y.cpu().double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[torch.float32], float(err)


def test_mixed_rank_classes_in_one_launch():
    """Ranks on both sides of the narrow rank class (16) in a rank-64 bank, tails NaN."""
    y, x, a, b, rs, ranks, scales, widths = mixed_rank_case(10, 40, [[4, 16, 17, 40, 64], [64, 1, 16, 0, 33]])
    ref = sliced_oracle(y, x, a, b, rs, ranks, scales, widths)
    y, x, a, b, rs, ranks, scales = _dev(y, x, a, b, rs, ranks, scales)
    y0 = y.clone()
    add_lora_slices(y, x, a, b, rs, widths=widths, ranks=ranks, scales=scales, backend="triton")
    assert torch.equal(y[rs < 0], y0[rs < 0])
    assert torch.equal(y[rs == 3, 32:], y0[rs == 3, 32:])  # rank 0 in slice 1
    err = (y.cpu().double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[torch.float32], float(err)


def test_decode_batch_sizes_share_compiled_kernels(monkeypatch):
    """Every decode bucket of a 256-row engine, for each module shape of an 8B model and 8 or
    64 slots, reaches the kernels with at most two sets of compile-time constants (split-K
    or not): split and column groups vary with the batch size but are runtime arguments
    (as constants each bucket would compile its own kernels inside the timed job)."""
    import inspect

    from mlora.batch.engine.graphs import BLOCK_M, buckets_for
    from mlora.kernels import tile_capacity
    from mlora.kernels import triton_sgmv as ts

    for kernel, name in ((ts._shrink_kernel, "split"), (ts._expand_kernel, "group_tiles")):
        param = inspect.signature(getattr(kernel, "fn", kernel)).parameters[name]
        assert param.annotation is inspect.Parameter.empty, name  # a runtime argument, not tl.constexpr

    monkeypatch.setattr(ts, "_num_sms", lambda device: 132)
    monkeypatch.setattr(ts, "_INTERPRET", False)
    shapes = {"qkv": (3, 4096, (4096, 1024, 1024)), "o": (1, 4096, (4096,)), "gate_up": (2, 4096, (14336, 14336)),
              "down": (1, 14336, (4096,))}
    varying = 0
    for slots in (8, 64):
        for name, (n, d_in, widths) in shapes.items():
            seen, splits, groups = set(), set(), set()
            for b in buckets_for(256):
                cfg = ts.launch_config(tile_capacity(b, slots, BLOCK_M), n, 16, d_in, widths, torch.device("cuda"),
                                       True, BLOCK_M)
                seen.add(tuple(cfg[k] for k in ts.COMPILE_KEYS) + (cfg["split"] > 1,))
                splits.add(cfg["split"])
                groups.add(cfg["group_tiles"])
            assert len(seen) <= 2, (slots, name, seen)
            varying += len(splits) >= 2 or len(groups) >= 2
    # the runtime arguments really vary across buckets for most shapes (with 8 slots the split
    # is the same 4 or 14 at every bucket): the constants above are what stays fixed
    assert varying >= 4, varying


def test_fill_from_rows_refills_only_when_the_row_slots_change(monkeypatch):
    """A static LaunchPlan remembers the row slots of its last fill: the same rows build and
    copy nothing, other rows refill it, and a direct ``copy_from`` makes it forget."""
    import mlora.kernels.launch as launch

    built = []
    real = launch.make_launch_plan
    monkeypatch.setattr(launch, "make_launch_plan", lambda *a, **k: built.append(1) or real(*a, **k))
    static = empty_launch_plan(6, tile_capacity(6, 3, 16), 16, "cpu")
    rows = torch.tensor([2, -1, 0, 2, 1, -1], dtype=torch.int32)
    plan = static.fill_from_rows(rows)
    assert len(built) == 1 and torch.equal(static.num_tiles, real(build_plan(rows), 16).num_tiles)
    static.tile_slot.fill_(-7)  # a skipped refill leaves this visible
    assert static.fill_from_rows(rows.clone()) is plan and len(built) == 1 and bool((static.tile_slot == -7).all())
    other = torch.tensor([0, 0, -1, 1, 1, 1], dtype=torch.int32)
    static.fill_from_rows(other)
    assert len(built) == 2 and int(static.num_tiles) == 2 and static.tile_slot[:2].tolist() == [0, 1]
    static.copy_from(real(build_plan(rows), 16))
    static.fill_from_rows(other)  # the copy replaced the contents: refilled, not trusted
    assert len(built) == 3 and static.tile_slot[:2].tolist() == [0, 1]
