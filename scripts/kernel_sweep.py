"""Launch-config variants of the segmented shrink + expand on a few step-2 shapes,
each timed the way `mlora bench kernels` times a case (one call captured in a
CUDA graph, replayed after a 256 MiB L2 flush, CUDA events, median of 30), and
checked against the float64 reference. How the defaults of
mlora.kernels.triton_sgmv.launch_config were chosen. Needs a CUDA GPU:

    PYTHONPATH=. python scripts/kernel_sweep.py [--defaults | --split]

Each line: the case (d_out / rank / T / adapters), its floor in µs, then µs per
variant ("default" is the current launch_config; the others override entries).
``--split``: the default config only, and where its time goes: the same graph
with the expand launch left out (``shrink_only``, output not checked) and with
neither launch (``empty``: the graph replay and the events themselves).
"""
import json
import statistics
import sys

import torch

from mlora.kernels import build_plan, empty_launch_plan, make_launch_plan, tile_capacity
from mlora.kernels.bench import OUTPUTS, case_floor, make_case, measure_ceilings, reference_f64
from mlora.kernels import triton_sgmv as sgmv
from mlora.kernels.triton_sgmv import add_lora_slices_triton

CASES = [("4096", 8, 1, 1), ("4096", 16, 16, 8), ("4096", 16, 64, 64), ("4096", 16, 256, 64), ("4096", 8, 256, 256),
         ("4096", 16, 1024, 64), ("4096", 64, 256, 64), ("4096", 64, 1024, 1), ("4096", 64, 1024, 8),
         ("4096", 64, 4096, 1), ("4096", 8, 4096, 64), ("4096", 16, 4096, 64), ("14336", 16, 64, 8),
         ("14336", 16, 256, 64), ("14336", 64, 256, 1), ("14336", 64, 1024, 1), ("14336", 64, 4096, 256),
         ("qkv", 16, 256, 64), ("qkv", 64, 64, 64), ("qkv", 64, 1024, 1), ("qkv", 16, 1024, 64),
         ("4096", "mixed", 256, 64)]
VARIANTS = {"default": {}, "no_pdl": dict(pdl=False), "waves4": dict(waves=4), "waves8": dict(waves=8),
            "group1": dict(group_tiles=1), "group2": dict(group_tiles=2), "block_n64": dict(block_n=64),
            "expand_warps8": dict(expand_warps=8), "sum_chunk4": dict(sum_chunk=4), "split1": dict(split=1),
            "split4": dict(split=4), "shrink_warps4": dict(shrink_warps=4), "shrink_warps8": dict(shrink_warps=8)}
if "--defaults" in sys.argv or "--split" in sys.argv:
    VARIANTS = {"default": {}}
SPLIT = "--split" in sys.argv


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def graph_median(graph, flush, reps=30):
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main():
    ceil = measure_ceilings()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for o, r, T, A in CASES:
        widths = OUTPUTS[o]
        ranks_per_slot = [(8, 16, 64)[i % 3] for i in range(A)] if r == "mixed" else [r] * A
        y0, x, a, b, rs, ranks, scales = make_case(T, A, widths, ranks_per_slot, max(ranks_per_slot))
        lp = make_launch_plan(build_plan(rs))
        static = empty_launch_plan(T, tile_capacity(T, A, lp.block_m), lp.block_m, "cuda")
        static.copy_from(lp)
        ref = reference_f64(y0, x, a, b, rs, ranks, scales, widths)
        floor = case_floor(T, widths, ranks_per_slot, torch.unique(rs).tolist(), ceil)["floor_s"] * 1e6
        row = {"case": f"{o}/r{r}/T{T}/A{A}", "floor_us": round(floor, 1)}
        variants = dict(VARIANTS)
        if SPLIT:
            variants.update(shrink_only={"__skip": ("_expand_kernel",)},
                            empty={"__skip": ("_shrink_kernel", "_expand_kernel")})
        for name, cfg in variants.items():
            skip = cfg.get("__skip", ()) if cfg else ()
            cfg = {k: v for k, v in (cfg or {}).items() if k != "__skip"}
            saved = {k: getattr(sgmv, k) for k in skip}
            for k in skip:
                setattr(sgmv, k, _NoLaunch())
            try:
                row[name] = _time_variant(y0, x, a, b, static, ranks, scales, widths, cfg, ref, flush, check=not skip)
            finally:
                for k, v in saved.items():
                    setattr(sgmv, k, v)
        print(json.dumps(row), flush=True)


def _time_variant(y0, x, a, b, static, ranks, scales, widths, cfg, ref, flush, check=True):
    """Median µs of one captured call (or "WRONG ..." when checked and not within 1e-2)."""
    y = y0.clone()
    call = lambda: add_lora_slices_triton(y, x, a, b, static, ranks, scales, widths, config=cfg or None)  # noqa: E731
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    y.copy_(y0)
    graph.replay()
    torch.cuda.synchronize()
    err = float((y.double() - ref).abs().max() / ref.abs().max()) if check else 0.0
    return round(graph_median(graph, flush), 1) if err < 1e-2 else f"WRONG (rel err {err:.2e})"

if __name__ == "__main__":
    main()
