"""Compile mlora's Triton kernels for an NVIDIA GPU target without a GPU (ptxas from the
Triton wheel): catches a kernel that the CPU interpreter runs but the compiler rejects,
before any device time is spent. Run with TRITON_INTERPRET unset.

    python scripts/compile_kernels.py [--arch 90]

Compiles the LoRA shrink and expand kernels (without and with split-K; narrow and wide
rank tiles; one and three slices; the bundle operator's variants with the bank-row map and
the JD-Full / JD-Diag core), the gate/up expand fused with the SiLU product, the
residency word-stats kernel and the paged attention kernel (decode and prefill tiles of an 8B shape) and the fused element-wise
kernels (add+RMSNorm, RoPE, SiLU product); prints one line per kernel (cubin size, registers,
spilled stack, and its global loads and stores by width: a mask at a runtime bound on a tensor's
contiguous axis turns 16-byte accesses into one 2-byte access per element) and exits 1 on the
first failure.
"""

import argparse
import collections
import inspect
import os
import re
import sys


def _resources(cubin: bytes) -> str:
    """", registers R, stack S bytes" from the Triton wheel's cuobjdump (S > 0: values spilled to
    local memory), or "" when the wheel has none."""
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f", registers {m.group(1)}, stack {m.group(2)} bytes" if m else ""


def _by_width(ops: list[tuple[str, str]], more_vectors: int = 0) -> str:
    """"N vector / M scalar (k b16, ...)" of PTX accesses matched as (vector suffix, type)."""
    scalar = collections.Counter(t for v, t in ops if not v)
    return (f"{sum(1 for v, _ in ops if v) + more_vectors} vector / {sum(scalar.values())} scalar"
            + (f" ({', '.join(f'{n} {t}' for t, n in sorted(scalar.items()))})" if scalar else ""))


def _global_accesses(ptx: str) -> str:
    """", global loads: N vector / M scalar (widths); stores: ..." from the PTX: scalar 16-bit
    accesses of a 16-bit tensor are what a mask on the contiguous axis at a runtime bound produces;
    cp.async copies count as vector loads.
    Scalar 32-bit ones are plan metadata and the shrink's fp32 z tile (a few per thread)."""
    access = r"\b{}\.global[.\w:]*?(\.v[248])?\.([busf]\d+)\b"
    copies = len(re.findall(r"\bcp\.async\.c[ag]\.shared\.global\b", ptx))
    return (f", global loads: {_by_width(re.findall(access.format('ld'), ptx), copies)}"
            f"; stores: {_by_width(re.findall(access.format('st'), ptx))}")


# integer arguments that are multiples of 16 at the 8B shapes (besides the strides), which a GPU
# launch marks as such: sizes (the norms' width, the SiLU's intermediate size, RoPE's half head,
# the word counts of a slot group's views), the LoRA bank's physical rank, and the expand's slice
# column offsets and shifts (sums of widths)
DIVISIBLE = ("d_in", "block_size", "k_per_split", "R", "O1", "O2", "O3", "O4", "D0", "D1", "D2", "D3", "n", "inter",
             "half", "n0", "n1")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    ap.add_argument("--no-marks", action="store_true",
                    help="compile without the alignment / divisibility marks a GPU launch gets")
    ap.add_argument("--dump", metavar="DIR", help="also write each kernel's PTX and cubin there "
                    "(LABEL.ptx, LABEL.cubin: for `cuobjdump -sass`)")
    args = ap.parse_args()
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter has nothing to compile", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mlora.kernels import elementwise as fused
    from mlora.kernels import paged_attention as pa
    from mlora.kernels import triton_sgmv as sgmv
    from mlora.kernels import wordstats

    target = GPUTarget("cuda", args.arch, 32)
    pointers = {"x_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "zp_ptr": "*fp32",
                "scales_ptr": "*fp32", "cnt_ptr": "*i32", "rows_ptr": "*i32", "tile_slot_ptr": "*i32",
                "tile_start_ptr": "*i32", "tile_end_ptr": "*i32", "num_tiles_ptr": "*i32", "ranks_ptr": "*i32",
                "bank_rows_ptr": "*i32", "core_ptr": "*bf16",
                "w_ptr": "*i16", "w0_ptr": "*i16", "w1_ptr": "*i16", "out_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
                "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "query_starts_ptr": "*i32",
                "tile_seq_ptr": "*i32", "tile_q0_ptr": "*i32", "scale_log2e": "fp32", "part_ptr": "*fp32",
                "stat_ptr": "*fp32",
                "h_ptr": "*bf16", "d_ptr": "*bf16", "hout_ptr": "*bf16", "eps": "fp32",
                "qkv_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "gu_ptr": "*bf16"}

    def build(kernel, consts: dict, label: str, types: dict | None = None, **options) -> None:
        names = inspect.signature(kernel.fn).parameters
        # compile-time options with a default (B_PITCHED) take it unless the build names them
        consts = {**{n: p.default for n, p in names.items() if p.default is not inspect.Parameter.empty}, **consts}
        signature = {n: "constexpr" if n in consts else (types or pointers).get(n, "i32") for n in names}
        # the specialisation a GPU launch gets for the 8B shapes (Triton marks each pointer that is
        # 16-byte aligned and each integer divisible by 16): every pointer (allocations and the
        # attention metadata's 64-byte offsets are aligned), the row and column strides and the
        # sizes that are multiples of 16; not the slot tables' strides (their slot count is any
        # number). Without the marks, loads are not vectorised: the decode attention kernel
        # needs 255 registers and spills instead of 94.
        # a parameter the kernel declares do_not_specialize gets no mark at a launch either
        unmarked = set(getattr(kernel, "do_not_specialize", ()) or ())
        attrs = {} if args.no_marks else {
            (i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
            if n not in consts and n not in unmarked and (signature[n].startswith("*") or n in DIVISIBLE
                                    or (n.startswith("stride_") and n not in ("stride_rj", "stride_rs")))}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs),
                                  target=target, options=options or None)
        print(f"ok  {label}: {len(compiled.asm['cubin'])} bytes of cubin{_resources(compiled.asm['cubin'])}"
              f"{_global_accesses(compiled.asm['ptx'])}")
        if args.dump:
            stem = os.path.join(args.dump, re.sub(r"[^\w.=-]+", "_", label))
            with open(stem + ".ptx", "w") as f:
                f.write(compiled.asm["ptx"])
            with open(stem + ".cubin", "wb") as f:
                f.write(compiled.asm["cubin"])

    import torch

    # the LoRA kernels with the block sizes, warps and stages launch_config gives them (16-row
    # tiles; 32-row tiles as large batches with long segments get them)
    for bm, cases in ((16, [(s, r) for s in (False, True) for r in (16, 64)]), (32, [(True, 64)])):
        for split_k, rank in cases:
            cfg = sgmv.launch_config(64, 1, rank, 4096, [4096], torch.device("cpu"), True, bm)
            build(sgmv._shrink_kernel,
                  dict(BLOCK_M=bm, RANK_CLASS=16, NATIVE_DOT=True, USE_PDL=args.arch >= 90, RANK_TILES=1,
                       BLOCK_R=cfg["block_r"], BLOCK_K=cfg["block_k"], SPLIT_K=split_k, SUM_CHUNK=cfg["sum_chunk"],
                       BANK_ROWS=False),
                  f"shrink block_m={bm} split_k={split_k} block_r={cfg['block_r']}",
                  num_warps=cfg["shrink_warps"], num_stages=cfg["shrink_stages"])
    for bm, cases in ((16, [(n, r) for n in (1, 3) for r in (16, 64)]), (32, [(3, 16), (3, 64)])):
        for slices, rank in cases:
            cfg = sgmv.launch_config(64, slices, rank, 4096, [4096] * slices, torch.device("cpu"), True, bm)
            build(sgmv._expand_kernel,
                  dict(BLOCK_M=bm, RANK_CLASS=16, NATIVE_DOT=True, USE_PDL=args.arch >= 90, N_SLICES=slices,
                       BLOCK_N=cfg["block_n"], BLOCK_R=cfg["block_r_expand"], BANK_ROWS=False, CORE=0),
                  f"expand block_m={bm} slices={slices} block_r={cfg['block_r_expand']}",
                  num_warps=cfg["expand_warps"], num_stages=cfg["expand_stages"])
    # the gate/up expand fused into the SiLU product (mlora.kernels.triton_act): decode-sized
    # (16-row tiles) and prefill-sized (32-row tiles, 128-wide columns), rank-pitched B
    from mlora.kernels import triton_act as ta

    act_types = {**pointers, "out_ptr": "*bf16", "base_rows_ptr": "*i32", "num_base_ptr": "*i32"}
    for bm in (16, 32):
        cfg = sgmv.launch_config(64, 2, 16, 4096, [14336] * 2, torch.device("cpu"), True, bm)
        build(ta._expand_silu_kernel,
              dict(BLOCK_M=bm, BLOCK_N=cfg["block_n"], BLOCK_R=cfg["block_r_expand"], NATIVE_DOT=True,
                   USE_PDL=args.arch >= 90, B_PITCHED=True),
              f"expand+silu block_m={bm} block_n={cfg['block_n']} block_r={cfg['block_r_expand']} rank-pitched B",
              types=act_types, num_warps=cfg["expand_warps"], num_stages=cfg["expand_stages"])
    # a rank-pitched B bank (mlora.kernels.pitch): row stride from the slot's rank, still whole vectors
    for rank in (16, 64):
        cfg = sgmv.launch_config(64, 3, rank, 4096, [4096] * 3, torch.device("cpu"), True, 16)
        build(sgmv._expand_kernel,
              dict(BLOCK_M=16, RANK_CLASS=16, NATIVE_DOT=True, USE_PDL=args.arch >= 90, N_SLICES=3,
                   BLOCK_N=cfg["block_n"], BLOCK_R=cfg["block_r_expand"], BANK_ROWS=False, CORE=0, B_PITCHED=True),
              f"expand block_m=16 slices=3 block_r={cfg['block_r_expand']} rank-pitched B",
              num_warps=cfg["expand_warps"], num_stages=cfg["expand_stages"])
    # the bundle operator (add_bundle_slices_triton): bank-row map in the shrink; map and core
    # (JD-Full R x R, JD-Diag R) in the expand; q/k/v-like groups of three slices
    cfg = sgmv.launch_config(64, 3, 64, 4096, [4096] * 3, torch.device("cpu"), True, 16)
    build(sgmv._shrink_kernel,
          dict(BLOCK_M=16, RANK_CLASS=16, NATIVE_DOT=True, USE_PDL=args.arch >= 90, RANK_TILES=1,
               BLOCK_R=cfg["block_r"], BLOCK_K=cfg["block_k"], SPLIT_K=True, SUM_CHUNK=cfg["sum_chunk"],
               BANK_ROWS=True),
          f"bundle shrink block_m=16 split_k=True block_r={cfg['block_r']}",
          num_warps=cfg["shrink_warps"], num_stages=cfg["shrink_stages"])
    for bm, rank, core in ((16, 16, 2), (16, 64, 2), (16, 64, 1), (32, 64, 2)):
        cfg = sgmv.launch_config(64, 3, rank, 4096, [4096] * 3, torch.device("cpu"), True, bm)
        build(sgmv._expand_kernel,
              # the core's contiguous stride is 1, which a launch specialises on like a constant
              dict(BLOCK_M=bm, RANK_CLASS=16, NATIVE_DOT=True, USE_PDL=args.arch >= 90, N_SLICES=3,
                   BLOCK_N=cfg["block_n"], BLOCK_R=cfg["block_r_expand"], BANK_ROWS=True, CORE=core,
                   **({"stride_cr": 1} if core == 1 else {"stride_ck": 1})),
              f"bundle expand block_m={bm} slices=3 block_r={cfg['block_r_expand']} "
              f"core={('jd-diag', 'jd-full')[core - 1]}",
              num_warps=cfg["expand_warps"], num_stages=cfg["expand_stages"])
    for unroll in (1, 4):
        build(wordstats._word_partials_kernel, dict(EXP=0x7F80, MAG=0x7FFF, MOD=65521, BLOCK=wordstats.BLOCK,
                                                 TILES=wordstats.TILES, UNROLL=unroll),
              f"residency word stats{'' if unroll == 1 else f', {unroll} blocks per step'}")
    group = 4  # 32 query heads over 8 KV heads, head_dim 128
    decode = dict(block_n=pa.DECODE_BLOCK_N, num_warps=pa.DECODE_WARPS,
                  **({"num_stages": pa.DECODE_STAGES} if pa.DECODE_STAGES is not None else {}))
    prefill = dict(block_n=pa.PREFILL_BLOCK_N, num_warps=pa.PREFILL_WARPS,
                   **({"num_stages": pa.PREFILL_STAGES} if pa.PREFILL_STAGES is not None else {}))
    for label, block_q, splits, launch in (("decode", pa.decode_block_q(group), 1, decode),
                                           ("prefill", pa.PREFILL_ROWS // group, 1, prefill),
                                           ("decode, split keys", pa.decode_block_q(group), 4, decode)):
        opts = dict(launch)
        block_n = opts.pop("block_n")
        build(pa._paged_attention_kernel, dict(GROUP=group, GROUP_P=group, BLOCK_Q=block_q, BLOCK_N=block_n,
                                               HEAD_DIM=128, BLOCK_D=128, NATIVE_DOT=True, SPLIT=splits > 1,
                                               HEADS_FIRST=label != "prefill"),
              f"paged attention ({label} tiles)", **opts)
    build(pa._merge_splits_kernel, dict(GROUP=group, GROUP_P=group, BLOCK_Q=pa.decode_block_q(group), HEAD_DIM=128,
                                        BLOCK_D=128), "paged attention split merge", num_warps=4)
    norm_ptrs = dict(pointers, w_ptr="*bf16", x_ptr="*bf16", out_ptr="*bf16")  # the fused kernels' own pointer names
    for delta in (False, True):
        build(fused._add_rms_norm_kernel, dict(HAS_DELTA=delta, BLOCK=4096), f"fused add+RMSNorm (delta={delta})",
              norm_ptrs)
    build(fused._rope_qk_kernel, dict(HALF_P2=64, HEADS_P2=64, WRITE_KV=False, KV_P2=1), "fused RoPE q/k", norm_ptrs)
    build(fused._rope_qk_kernel, dict(HALF_P2=64, HEADS_P2=64, WRITE_KV=True, KV_P2=8),
          "fused RoPE q/k + KV cache write", dict(norm_ptrs, k_ptr="*bf16", v_ptr="*bf16", slot_ptr="*i64"))
    build(fused._silu_mul_kernel, dict(BLOCK=1024), "fused SiLU product", norm_ptrs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
