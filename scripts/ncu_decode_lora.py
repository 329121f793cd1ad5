"""One decoder layer's decode-size LoRA launches (the four shrink + expand pairs of
``kernel_sweep.py --decode``: q/k/v, o, gate/up from d_in 4096, down from 14336; rank 16;
256 rows over 64 and over 8 adapters; rank-pitched B as the engine reads it), run eagerly
so Nsight Compute can read each kernel's hardware counters (issue step 7: where a decode
shrink's ~10 us of fixed cost goes). Needs a CUDA GPU. Under ncu::

    ncu --clock-control none --set full -k regex:"_shrink_kernel|_expand_kernel" \\
        --launch-skip 16 --launch-count 8 -o /tmp/lora python scripts/ncu_decode_lora.py
    ncu -i /tmp/lora.ncu-rep --page details > details.txt

Per adapter count (64, then 8) the layer's eight kernels (per module: q/k/v, o, gate/up,
down; shrink then expand) run three times: two warm-up rounds (compiles), then a timed one.
``--launch-skip 16 --launch-count 8`` profiles the third round at 64 adapters, ``--launch-skip
40`` the third at 8 (``bash scripts/gpu_session.sh ncu-lora`` runs both). Without ncu the
script prints each pair's eager time (CUDA events, no L2 flush): a check that it runs, not a
benchmark (under ncu these times include the profiler's replays).
"""
import sys

import torch

from mlora.kernels import build_plan, to_rank_pitched
from mlora.bench.kernels import OUTPUTS, captured_plan, make_case
from mlora.kernels.triton_sgmv import add_lora_slices_triton

MODULES = {"qkv": (OUTPUTS["qkv"], 4096), "o": ((4096,), 4096), "gateup": ((14336, 14336), 4096),
           "down": ((4096,), 14336)}


def cases(adapters: int):
    """The layer's four (name, y, call) of one adapter count (cases built once)."""
    out = []
    for name, (widths, d_in) in MODULES.items():
        y0, x, a, b, rs, ranks, scales = make_case(256, adapters, widths, [16] * adapters, 16, d_in=d_in)
        static = captured_plan(build_plan(rs), adapters)
        bank = to_rank_pitched(b, ranks, widths)
        y = y0.clone()
        out.append((name, lambda y=y, x=x, a=a, bank=bank, static=static, ranks=ranks, scales=scales, widths=widths:
                    add_lora_slices_triton(y, x, a, bank, static, ranks, scales, widths, b_pitched=True)))
    return out


def main():
    if not torch.cuda.is_available():
        sys.exit("ncu_decode_lora.py needs a CUDA GPU")
    for adapters in (64, 8):
        layer = cases(adapters)
        for _ in range(2):  # the first round compiles; ncu's --launch-skip passes over it
            for _, call in layer:
                call()
        torch.cuda.synchronize()
        for name, call in layer:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            print(f"{adapters} adapters {name}: {start.elapsed_time(end) * 1e3:.1f} us (eager pair)", flush=True)


if __name__ == "__main__":
    main()
