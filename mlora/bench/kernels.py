"""The segmented-kernel benchmark behind ``mlora bench kernels``.

Owns the measurement method; the figures go into BENCHMARKS.md.

* Ceilings, measured in the same run: copy bandwidth (a large device-to-device
  copy, bytes read + written over time) and the bf16 matmul rate (8192^3).
* Floors per case: bytes = the distinct adapters' A and B at true rank + x
  read + y read and written; flops = 2 * rows * rank * (n * d_in + d_out);
  floor = max(bytes / bandwidth, flops / rate).
* Triton, graph-replayed: one shrink + expand call captured in a CUDA graph
  over a static LaunchPlan; each timed replay follows an L2 flush
  (a 256 MiB write) so the factors come from HBM, timed with CUDA events; median.
* Triton eager and the baselines (per-adapter loop = PEFT's way; gather +
  batched matmul): back-to-back calls, wall time per call after a sync (what a
  Python caller pays, launch overhead included; L2 stays warm, which favours
  the baselines). Gather-BMM is skipped where its gathered factors would
  exceed 4 GiB.
* Correctness: the graph-replayed output of every case is compared with a
  float64 per-slot reference of the same rows (relative max error < 1e-2).

Rows are assigned to adapters uniformly at random (no base-only rows).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from mlora.kernels import (
    LaunchPlan,
    SegmentPlan,
    add_lora_slices,
    build_plan,
    empty_launch_plan,
    make_launch_plan,
    tile_capacity,
    to_rank_pitched,
)
from mlora.kernels.reference import lora_gather_bmm, lora_loop

D_IN = 4096
OUTPUTS = {"4096": (4096,), "14336": (14336,), "qkv": (4096, 1024, 1024)}
RANKS = (8, 16, 64)
TOKENS = (1, 16, 64, 256, 1024, 4096)
ADAPTERS = (1, 8, 64, 256)
QUICK_TOKENS = (1, 64, 256, 4096)
GATHER_LIMIT = 4 << 30


@dataclass
class Ceilings:
    copy_bytes_per_s: float
    bf16_flops_per_s: float


def _events_median(fn, reps: int, flush: torch.Tensor | None = None) -> float:
    """Median seconds of ``reps`` event-timed calls of ``fn``, each after ``flush`` is zeroed
    (an L2 flush) when given."""
    return statistics.median(_events_times(fn, reps, flush))


def _events_times(fn, reps: int, flush: torch.Tensor | None = None) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` between two CUDA events (``flush`` zeroed
    before each call when given)."""
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


class NoLaunch:
    """Stands in for a Triton kernel in the sweep scripts: ``kernel[grid](...)`` launches
    nothing (a launch left out of a timed call, e.g. the expand when timing the shrink alone)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def graph_of(fn, copies: int = 1) -> torch.cuda.CUDAGraph:
    """``fn`` run once (compiles, warms), then ``copies`` calls of it captured in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(copies):
            fn()
    torch.cuda.synchronize()
    return graph


def _wall_per_call(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def measure_ceilings(reps: int = 20) -> Ceilings:
    """The GPU's copy bandwidth (a 2 GiB bf16 device-to-device copy: read + write bytes) and bf16
    matmul rate (8192^3), each the fastest of ``reps`` event-timed calls after one warm-up call.
    A ceiling is the best the hardware does: noise (clocks, other tenants of the memory
    system) only slows a call, so the fastest call estimates it and repeats agree (a median
    moves with the noise, and every floor with it)."""
    n = 1 << 30  # 2 GiB of bf16
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    t_copy = _events_best(lambda: dst.copy_(src), reps)
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    t_mm = _events_best(lambda: a @ b, reps)
    return Ceilings(copy_bytes_per_s=2 * 2 * n / t_copy, bf16_flops_per_s=2 * m**3 / t_mm)


def sustained_matmul_rate(seconds: float = 3.0) -> float:
    """bf16 flops per second of 8192^3 matmuls run back to back for ``seconds``
    (:func:`sustained_rate`). Not a ceiling of the floors (those use the burst rate of
    :func:`measure_ceilings`) but what the GPU holds under sustained load, where a power cap
    lowers the clocks (figures in BENCHMARKS.md)."""
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    return sustained_rate(lambda: a @ b, 2 * m**3, seconds)[0]


def sustained_rate(fn, work: float, seconds: float = 3.0, batch: int = 10) -> tuple[float, tuple[float, float]]:
    """``fn`` (one GPU call doing ``work`` units: bytes, flops) run back to back for ``seconds``
    after one warm-up call, synchronised every ``batch`` calls: (units per second over the
    second half, after the clocks settle; that half's ``(start, end)`` in ``time.perf_counter``
    time, e.g. for :meth:`mlora.bench.gpuclocks.ClockSampler.summary`). A run too short to
    reach its second half is measured whole."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 0
    half = None
    while time.perf_counter() - t0 < seconds:
        for _ in range(batch):
            fn()
        n += batch
        torch.cuda.synchronize()
        if half is None and time.perf_counter() - t0 >= seconds / 2:
            half = (time.perf_counter(), n)
    t1 = time.perf_counter()
    if half is None or n == half[1]:
        return work * n / (t1 - t0), (t0, t1)
    return work * (n - half[1]) / (t1 - half[0]), (half[0], t1)


def _events_best(fn, reps: int) -> float:
    """Seconds of the fastest of ``reps`` event-timed calls of ``fn``, after one untimed call."""
    fn()
    return min(_events_times(fn, reps))


def make_case(T: int, n_adapters: int, widths, ranks_per_slot, R: int, seed: int = 0, device="cuda",
              d_in: int = D_IN):
    """Bank of ``n_adapters`` slots (true ranks ``ranks_per_slot``, physical R) and T rows of
    ``d_in`` inputs (the grid's 4096 unless a sweep asks for another, e.g. down_proj's 14336)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = len(widths)
    S = n_adapters
    x = torch.randn(T, d_in, generator=g).to(device, torch.bfloat16)
    a = (torch.randn(S, n, R, d_in, generator=g) / math.sqrt(d_in)).to(device, torch.bfloat16)
    b = (torch.randn(S, sum(widths), R, generator=g) / math.sqrt(R)).to(device, torch.bfloat16)
    ranks = torch.tensor(ranks_per_slot, dtype=torch.int32).repeat(n, 1).to(device)
    scales = (torch.rand(n, S, generator=g) + 0.5).to(device)
    rs = torch.randint(0, S, (T,), generator=g, dtype=torch.int32).to(device)
    y = torch.randn(T, sum(widths), generator=g).to(device, torch.bfloat16)
    return y, x, a, b, rs, ranks, scales


def captured_plan(plan: SegmentPlan, n_adapters: int, block_m: int | None = None) -> LaunchPlan:
    """``plan``'s tiles in static buffers sized as the engine sizes a captured batch of its rows
    over ``n_adapters`` slots (``tile_capacity``), so a timed call sees the tile count a CUDA
    graph replays; ``block_m``: the row tile (default: the plan's own choice)."""
    lp = make_launch_plan(plan, block_m)
    T = plan.num_rows
    static = empty_launch_plan(T, tile_capacity(T, n_adapters, lp.block_m), lp.block_m, plan.starts.device)
    static.copy_from(lp)
    return static


def reference_f64(y, x, a, b, rs, ranks, scales, widths) -> torch.Tensor:
    """y + delta in float64, one exact-rank product per (slot, slice): the oracle's formula."""
    out = y.double().clone()
    off = 0
    for j, w in enumerate(widths):
        for s in torch.unique(rs).tolist():
            rows = torch.nonzero(rs == s).flatten()
            r = int(ranks[j, s])
            z = x[rows].double() @ a[s, j, :r].double().T
            out[rows, off : off + w] += float(scales[j, s]) * (z @ b[s, off : off + w, :r].double().T)
        off += w
    return out


def case_floor(T, widths, ranks_per_slot, used_slots, ceil: Ceilings, d_in: int = D_IN) -> dict:
    n = len(widths)
    adapter_bytes = sum(ranks_per_slot[s] * (n * d_in + sum(widths)) * 2 for s in used_slots)
    io_bytes = T * d_in * 2 + 2 * T * sum(widths) * 2
    mean_rank = sum(ranks_per_slot[s] for s in used_slots) / max(len(used_slots), 1)
    flops = 2 * T * mean_rank * (n * d_in + sum(widths))  # approximate when ranks differ per slot
    t_bytes = (adapter_bytes + io_bytes) / ceil.copy_bytes_per_s
    t_flops = flops / ceil.bf16_flops_per_s
    return dict(bytes=adapter_bytes + io_bytes, flops=flops, floor_s=max(t_bytes, t_flops),
                bound="memory" if t_bytes >= t_flops else "compute")


def run_case(T, n_adapters, out_name, ranks_per_slot, R, ceil: Ceilings, flush, baselines=True, seed=0,
             b_layout="padded") -> dict:
    """One grid case timed as the engine runs it (captured, replayed after an L2 flush) and
    checked against the float64 reference; ``b_layout="rank-pitched"``: the Triton call reads
    the B bank in that layout (``mlora.kernels.pitch``; the reference and baselines read the
    padded one)."""
    widths = OUTPUTS[out_name]
    y0, x, a, b, rs, ranks, scales = make_case(T, n_adapters, widths, ranks_per_slot, R, seed)
    b_call = to_rank_pitched(b, ranks, widths) if b_layout == "rank-pitched" else b
    used = torch.unique(rs).tolist()
    res = dict(T=T, adapters=n_adapters, d_out=out_name, R=R, ranks=sorted(set(ranks_per_slot)),
               distinct_used=len(used), **case_floor(T, widths, ranks_per_slot, used, ceil))
    seg = build_plan(rs)
    static = captured_plan(seg, n_adapters)
    y = y0.clone()
    kw = dict(widths=widths, ranks=ranks, scales=scales, backend="triton", plan=static, check_values=False,
              b_layout=b_layout)
    call = lambda: add_lora_slices(y, x, a, b_call, rs, **kw)  # noqa: E731
    call()  # compile + warm
    res["triton_eager_s"] = _wall_per_call(call, 20)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    y.copy_(y0)
    graph.replay()
    ref = reference_f64(y0, x, a, b, rs, ranks, scales, widths)
    err = float((y.double() - ref).abs().max() / ref.abs().max())
    res["max_rel_err"] = err
    res["correct"] = err < 1e-2
    res["triton_graph_s"] = _events_median(graph.replay, 30, flush)
    res["fraction"] = res["floor_s"] / res["triton_graph_s"]
    t0 = time.perf_counter()
    for _ in range(5):
        make_launch_plan(build_plan(rs))
    torch.cuda.synchronize()
    res["plan_build_s"] = (time.perf_counter() - t0) / 5
    del graph
    if baselines:
        def loop():
            off = 0
            for j, w in enumerate(widths):
                lora_loop(y[:, off : off + w], x, a[:, j], b[:, off : off + w], rs, ranks[j], scales[j], seg)
                off += w

        reps = 3 if n_adapters >= 64 else 10
        res["loop_s"] = _wall_per_call(loop, reps)
        gathered = T * R * (len(widths) * D_IN + sum(widths)) * 4
        if gathered <= GATHER_LIMIT:
            def bmm():
                off = 0
                for j, w in enumerate(widths):
                    lora_gather_bmm(y[:, off : off + w], x, a[:, j], b[:, off : off + w], rs, ranks[j], scales[j])
                    off += w

            res["gather_bmm_s"] = _wall_per_call(bmm, reps)
        else:
            res["gather_bmm_s"] = None
    return res


def grid(quick: bool):
    tokens = QUICK_TOKENS if quick else TOKENS
    for out_name in OUTPUTS:
        for rank in RANKS:
            for T in tokens:
                for n in ADAPTERS:
                    if n <= T:
                        yield out_name, rank, T, n


# (rows T, adapters, d_out) of the mixed-rank comparison. The first three (64 adapters, d_out
# 4096) cannot reach 0.6x the padded time whatever the kernel: at T 64 and 256 the mixed
# batch's own floor is launch-bound and at T 4096 x and y outweigh the factors. The last two
# are factor-bound: 256 adapters of d_out 14336, one to four rows each.
MIXED_CASES = ((64, 64, "4096"), (256, 64, "4096"), (4096, 64, "4096"), (256, 256, "14336"), (1024, 256, "14336"))


def mixed_rank_cases(ceil, flush, cases=MIXED_CASES):
    """Ranks 8/16/64 in one batch against the same rows with every slot at rank 64
    (``floor_ratio``: the same ratio of the two memory floors, the best possible;
    ``mixed_floor_s`` below 10 us: the mixed batch is launch-bound). The mixed batch reads a
    rank-pitched B bank, the engine's layout (``mixed_s``), and for comparison the padded one
    (``mixed_padded_layout_s``); the padded twin's bank is the
    same bytes in both layouts (every rank is R)."""
    out = []
    for T, n, d_out in cases:
        mixed = [(8, 16, 64)[s % 3] for s in range(n)]
        m = run_case(T, n, d_out, mixed, 64, ceil, flush, baselines=False, seed=1, b_layout="rank-pitched")
        mp = run_case(T, n, d_out, mixed, 64, ceil, flush, baselines=False, seed=1)
        p = run_case(T, n, d_out, [64] * n, 64, ceil, flush, baselines=False, seed=1)
        out.append(dict(T=T, adapters=n, d_out=d_out, mixed_s=m["triton_graph_s"], padded_s=p["triton_graph_s"],
                        mixed_padded_layout_s=mp["triton_graph_s"],
                        floor_ratio=m["floor_s"] / p["floor_s"], mixed_floor_s=m["floor_s"], padded_floor_s=p["floor_s"],
                        ratio=m["triton_graph_s"] / p["triton_graph_s"],
                        correct=m["correct"] and mp["correct"] and p["correct"]))
    return out


def summarize(cases, mixed) -> dict:
    big = [c for c in cases if c["floor_s"] >= 10e-6]
    small = [c for c in cases if c["floor_s"] < 10e-6]
    geo = math.exp(sum(math.log(c["fraction"]) for c in big) / len(big)) if big else None
    speedups = [c["loop_s"] / c["triton_graph_s"] for c in cases
                if c["T"] <= 256 and c["adapters"] >= 64 and c.get("loop_s")]
    s = dict(
        cases=len(cases),
        all_correct=all(c["correct"] for c in cases) and all(m["correct"] for m in mixed),
        floor_ge_10us_cases=len(big),
        fraction_geomean=geo,
        fraction_min=min((c["fraction"] for c in big), default=None),
        launch_bound_cases=len(small),
        launch_bound_max_s=max((c["triton_graph_s"] for c in small), default=None),
        loop_speedup_min=min(speedups, default=None),
        mixed_ratio_max=max((m["ratio"] for m in mixed), default=None),
        # the same over the mixed cases where 0.6x is attainable at all: the mixed batch's own
        # floor >= 10 us (not launch-bound, the split the other targets use) and floor ratio <= 0.6
        mixed_ratio_max_attainable=max((m["ratio"] for m in mixed if m["mixed_floor_s"] >= 10e-6
                                        and m["floor_ratio"] <= 0.6), default=None),
    )
    s["targets"] = dict(
        fraction_geomean_ge_0_4=geo is not None and geo >= 0.4,
        fraction_min_ge_0_15=s["fraction_min"] is not None and s["fraction_min"] >= 0.15,
        launch_bound_le_12us=s["launch_bound_max_s"] is not None and s["launch_bound_max_s"] <= 12e-6,
        loop_speedup_ge_10x=s["loop_speedup_min"] is not None and s["loop_speedup_min"] >= 10,
        mixed_le_0_6_padded=s["mixed_ratio_max"] is not None and s["mixed_ratio_max"] <= 0.6,
        mixed_le_0_6_padded_where_attainable=(s["mixed_ratio_max_attainable"] is not None
                                              and s["mixed_ratio_max_attainable"] <= 0.6),
    )
    return s


def run_kernel_bench(quick: bool = False, baselines: bool = True, progress=None) -> dict:
    """Run the whole grid on the current CUDA device; returns a JSON-able dict."""
    if not torch.cuda.is_available():
        raise RuntimeError("mlora bench kernels needs a CUDA GPU")
    ceil = measure_ceilings()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    cases = []
    for out_name, rank, T, n in grid(quick):
        c = run_case(T, n, out_name, [rank] * n, rank, ceil, flush, baselines)
        cases.append(c)
        if progress:
            progress(c)
    mixed = mixed_rank_cases(ceil, flush)
    return dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        ceilings=dict(copy_bytes_per_s=ceil.copy_bytes_per_s, bf16_flops_per_s=ceil.bf16_flops_per_s),
        cases=cases,
        mixed_rank=mixed,
        summary=summarize(cases, mixed),
    )
