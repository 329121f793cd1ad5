"""Where do the base GEMMs of a decode iteration stand, and does another cuBLAS call shape beat them?

A probe, not an engine path. Issue step 7's base target at 256 running rows (1.4x the
iteration floor) is missed by a few percent; the nineteenth session's profile put the
base GEMMs at ~1.23x their flop floor (gate/up 100 us a launch, nvjet 256x128 tiles:
224 output tiles on 132 SMs, 1.7 waves). For each Llama-3-8B decoder-layer GEMM and the
lm_head at 64 and 256 rows, bf16, each variant's time per call: ``copies`` calls
captured in one CUDA graph cycling through enough weight copies that nothing stays in
L2, replayed, CUDA events, median of 20 replays over ``copies``.

  linear        F.linear(x, W) with torch's default BLAS choice (what the engine runs)
  linear_lt     the same with torch.backends.cuda.preferred_blas_library("cublaslt")
  linear_cublas the same with preferred_blas_library("cublas")
  addmm_bias    F.linear(x, W, zero bias) (torch routes a biased bf16 linear to cublasLt's epilogue)
  mm_transposed torch.mm(W, x.T): the transposed problem (y^T, [N, M]); other tile choices
  split2        (gate/up only) two F.linear over the two halves of W
  split2_out    (gate/up only) two torch.mm into the halves of one output (what an engine split would run)

Each figure beside its floor: max(bytes / 4.2 TB/s, flops / the matmul rate measured here
at 8192^3) with bytes = W + x + y. Then per variant the layer's sum over 32 layers + lm_head.

    PYTHONPATH=. python scripts/gemm_probe.py [--rows 64,256]
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from mlora.batch.model.gemms import preferring
from mlora.bench.kernels import _events_median, graph_of, measure_ceilings

# (name, N, K) of one decoder layer (fused q/k/v and gate/up, as the engine holds them) and the head
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gateup", 28672, 4096), ("down", 4096, 14336),
          ("lm_head", 128256, 4096)]
ROWS = (64, 256)  # --rows 32,96,128 for others
LAYERS = 32
L2_CLEAR_BYTES = 200 << 20  # weight copies cycled per graph: together at least this much


def variants(name: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> dict:
    out = {"linear": lambda: F.linear(x, w), "addmm_bias": lambda: F.linear(x, w, bias),
           "mm_transposed": lambda: torch.mm(w, x.t())}
    if name == "gateup":
        half = w.shape[0] // 2
        out["split2"] = lambda: (F.linear(x, w[:half]), F.linear(x, w[half:]))
        def split2_out():  # two GEMMs written in place into the halves of one output
            y = x.new_empty(x.shape[0], w.shape[0])
            torch.mm(x, w[:half].t(), out=y[:, :half])
            torch.mm(x, w[half:].t(), out=y[:, half:])
            return y
        out["split2_out"] = split2_out
    return out


def time_call(make, weights, flush, blas: str | None) -> float:
    """Seconds per call: one call per weight copy captured in a graph, replayed (median)."""
    with preferring(blas):  # the preference is captured with the kernels
        calls = [make(w) for w in weights]
        graph = graph_of(lambda: [c() for c in calls])
    return _events_median(graph.replay, 20, flush) / len(weights)


def main() -> None:
    global ROWS
    if "--rows" in sys.argv:
        ROWS = tuple(int(r) for r in sys.argv[sys.argv.index("--rows") + 1].split(","))
    ceil = measure_ceilings()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    print(json.dumps({"copy_tb_s": round(ceil.copy_bytes_per_s / 1e12, 2),
                      "matmul_tflop_s": round(ceil.bf16_flops_per_s / 1e12, 1),
                      "blas_default": str(torch.backends.cuda.preferred_blas_library())}), flush=True)
    per_call: dict[tuple[int, str, str], float] = {}  # (rows, gemm, variant) -> seconds per iteration
    floors: dict[int, float] = {}
    g = torch.Generator(device="cpu").manual_seed(0)
    for name, N, K in SHAPES:
        copies = max(1, -(-L2_CLEAR_BYTES // (N * K * 2)))
        weights = [(torch.randn(N, K, generator=g) / K**0.5).to("cuda", torch.bfloat16) for _ in range(copies)]
        bias = torch.zeros(N, dtype=torch.bfloat16, device="cuda")
        times = LAYERS if name != "lm_head" else 1
        for M in ROWS:
            x = torch.randn(M, K, generator=g).to("cuda", torch.bfloat16)
            ref = F.linear(x.float(), weights[0].float())
            flops = 2 * M * N * K
            floor = max((N * K + M * K + M * N) * 2 / ceil.copy_bytes_per_s, flops / ceil.bf16_flops_per_s)
            floors[M] = floors.get(M, 0.0) + floor * times
            row = {"gemm": name, "M": M, "N": N, "K": K, "floor_us": round(floor * 1e6, 1)}
            for label, blas in (("", None), ("_lt", "cublaslt"), ("_cublas", "cublas")):
                for vname in variants(name, x, weights[0], bias):
                    if label and vname != "linear":
                        continue
                    key = vname + label

                    def make(w, vname=vname):
                        return variants(name, x, w, bias)[vname]
                    try:
                        with preferring(blas):
                            got = make(weights[0])()
                        got = torch.cat(got, dim=1) if isinstance(got, tuple) else got
                        if vname == "mm_transposed":
                            got = got.t()
                        err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
                        if err > 2e-2:
                            row[key] = f"WRONG {err:.3g}"
                            continue
                        t = time_call(make, weights, flush, blas)
                    except Exception as exc:  # a BLAS choice this build lacks
                        row[key] = f"FAILED {type(exc).__name__}: {exc}"[:120]
                        continue
                    row[key] = round(t * 1e6, 1)
                    per_call[(M, name, key)] = t * times
            print(json.dumps(row), flush=True)
        del weights
        torch.cuda.empty_cache()
    keys = sorted({k for (_, _, k) in per_call})
    for M in ROWS:
        # a variant that does not exist for a GEMM (split2) or failed counts that GEMM's plain linear
        totals = {k: sum(per_call.get((M, s[0], k), per_call.get((M, s[0], "linear"), 0.0)) for s in SHAPES)
                  for k in keys}
        parts = [f"{k}: {v * 1e3:.2f} ms ({v / floors[M]:.2f}x)" for k, v in totals.items()]
        print(f"{M} rows, {LAYERS} layers + lm_head: floor {floors[M] * 1e3:.2f} ms; " + "; ".join(parts))


if __name__ == "__main__":
    main()
