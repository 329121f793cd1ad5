"""Where the fixed cost of one LoRA launch pair at decode size goes (issue step 7: ~10 us per
shrink + expand pair over ~1-2 us of bytes). Needs a CUDA GPU:

    PYTHONPATH=. python scripts/lora_latency.py

For the four launches of one Llama-3-8B decoder layer (q/k/v, o, gate/up, down; rank 16; 256
rows over 8 and 64 adapters; the plan buffers sized as in kernel_sweep.py), each timed as one
captured CUDA graph, median of 30 replays, each after a 256 MiB L2 flush (the flush also keeps
the GPU busy while the host submits the replay: timed on an idle GPU, a one-kernel graph shows
the host's submission, 11 us for the no-op, seventeenth session):

  pair          the default shrink + expand
  shrink        the shrink alone (expand not launched)
  shrink_empty  the shrink over a plan with no tiles (every program loads the plan and exits)
  pair_x8       eight copies of the pair in one graph, per copy: back-to-back cost
  gemm, gemm_pair  the module's base GEMM (x @ W.T, W [sum(widths), d_in] bf16) alone and followed
                by the pair, as the engine runs them: the pair's cost after a GEMM is the difference
  noop          a one-program Triton kernel that stores one value (the launch itself)

The flush also evicts the GPU's TLB entries for the plan, x and the banks, as the engine's
weight streaming does between two LoRA launches.
"""
import json

import torch
import triton
import triton.language as tl

from mlora.kernels import build_plan, empty_launch_plan
from mlora.kernels import triton_sgmv as sgmv
from mlora.bench.kernels import NoLaunch, _events_median, captured_plan, graph_of, make_case
from mlora.kernels.triton_sgmv import add_lora_slices_triton

OUTPUTS = {"qkv": ((4096, 1024, 1024), 4096), "o": ((4096,), 4096), "gateup": ((14336, 14336), 4096),
           "down": ((4096,), 14336)}


@triton.jit
def _noop(out_ptr):
    tl.store(out_ptr, 1.0)


def _times(g, flush, copies=1):
    return round(_events_median(g.replay, 30, flush) * 1e6 / copies, 1)


def main():
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    out = torch.zeros(1, device="cuda")
    g = graph_of(lambda: _noop[(1,)](out))
    print(json.dumps({"case": "noop", "us": _times(g, flush)}), flush=True)
    for A in (8, 64):
        for name, (widths, d_in) in OUTPUTS.items():
            y0, x, a, b, rs, ranks, scales = make_case(256, A, widths, [16] * A, 16, d_in=d_in)
            static = captured_plan(build_plan(rs), A)
            empty = empty_launch_plan(256, static.tile_capacity, static.block_m, "cuda")  # num_tiles 0
            y = y0.clone()
            row = {"case": f"{name}/r16/T256/A{A}"}

            def call(plan=static):
                add_lora_slices_triton(y, x, a, b, plan, ranks, scales, widths, config={"fused": False})

            row["pair"] = _times(graph_of(call), flush)
            w = torch.randn(sum(widths), d_in, device="cuda", dtype=torch.bfloat16) / d_in**0.5
            base = torch.empty(256, sum(widths), device="cuda", dtype=torch.bfloat16)

            def gemm():
                torch.matmul(x, w.T, out=base)

            def gemm_pair():
                gemm()
                add_lora_slices_triton(base, x, a, b, static, ranks, scales, widths, config={"fused": False})

            row["gemm"] = _times(graph_of(gemm), flush)
            row["gemm_pair"] = _times(graph_of(gemm_pair), flush)
            row["pair_x8"] = _times(graph_of(call, 8), flush, 8)
            saved = sgmv._expand_kernel
            sgmv._expand_kernel = NoLaunch()
            try:
                row["shrink"] = _times(graph_of(call), flush)
                row["shrink_empty"] = _times(graph_of(lambda: call(empty)), flush)
            finally:
                sgmv._expand_kernel = saved
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
