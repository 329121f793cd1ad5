"""Per-kernel GPU times (CUPTI, after an L2 flush) of the segmented shrink and
expand for a few step-2 shapes and launch-config variants: how the defaults of
mlora.kernels.triton_sgmv.launch_config were chosen. Needs a CUDA GPU:

    PYTHONPATH=. python scripts/kernel_sweep.py [--defaults]
"""
import json
import sys

import torch
from torch.profiler import profile, ProfilerActivity
from mlora.kernels import build_plan, make_launch_plan, empty_launch_plan, tile_capacity
from mlora.kernels.bench import make_case, OUTPUTS
from mlora.kernels.triton_sgmv import add_lora_slices_triton

flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
CASES = [("4096", 64, 4096, 1), ("4096", 16, 4096, 1), ("4096", 16, 256, 64), ("4096", "mixed", 256, 64), ("4096", 64, 256, 64),
         ("4096", "mixed", 4096, 64), ("4096", 64, 4096, 64), ("14336", 64, 4096, 64), ("qkv", 64, 1024, 1), ("4096", 16, 64, 1)]
VARIANTS = [dict(), dict(block_r=16), dict(block_n=256), dict(block_n=256, expand_warps=8), dict(expand_stages=3),
            dict(expand_stages=4), dict(group_tiles=2), dict(bm=64, expand_warps=8), dict(bm=64, block_n=64, expand_warps=8),
            dict(bm=32, block_n=64)]
if "--defaults" in sys.argv:  # only the default launch config
    VARIANTS = [dict()]
for (o, r, T, A) in CASES:
    widths = OUTPUTS[o]
    rk = [(8, 16, 64)[i % 3] for i in range(A)] if r == "mixed" else [r] * A
    y, x, a, b, rs, ranks, scales = make_case(T, A, widths, rk, max(rk))
    seg = build_plan(rs)
    for v in VARIANTS:
        v = dict(v)
        bm = v.pop("bm", None)
        lp = make_launch_plan(seg, bm or 16)
        st = empty_launch_plan(T, tile_capacity(T, A, lp.block_m), lp.block_m, "cuda"); st.copy_from(lp)
        f = lambda: add_lora_slices_triton(y, x, a, b, st, ranks, scales, widths, config=v)
        try:
            f(); torch.cuda.synchronize()
        except Exception as e:
            print(o, r, T, A, v, "FAIL", str(e)[:80]); continue
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(10):
                flush.zero_(); f()
            torch.cuda.synchronize()
        t = {}
        for e in p.key_averages():
            if "shrink" in e.key or "expand" in e.key:
                t["shrink" if "shrink" in e.key else "expand"] = e.device_time_total / e.count
        print(f"{o:>6} r{r!s:<5} T={T:<5} A={A:<4} bm={lp.block_m:<3} {json.dumps(v):40s} shrink {t.get('shrink',0):7.1f} expand {t.get('expand',0):7.1f} us", flush=True)
