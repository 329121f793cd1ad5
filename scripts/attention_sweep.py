"""Paged attention alone: launch parameters against the floor (step 7; BENCHMARKS.md).

    python scripts/attention_sweep.py [--rows 64,256] [--quick]
    python scripts/attention_sweep.py --prefill [--tokens 8192] [--quick]
    python scripts/attention_sweep.py --order [--rows 64,256]

One Llama-3-8B layer's decode launch (32 query heads, 8 KV heads, head_dim
128, bf16, 16-token pages in shuffled order), ``rows`` sequences with context
lengths uniform in [129, 1152] (the ``bench batch`` job: prompts in
[128, 1024] plus up to 128 generated tokens; seeded). For every combination
of keys per step (``DECODE_BLOCK_N``), warps, pipelining stages and key
splits, the launch (plus the merge when split) is replayed from a CUDA graph
(``triton.testing.do_bench_cudagraph``) and printed beside the floor: K and V
bytes read / the copy bandwidth measured in the same run. Every config's
output is compared with the default config's (max abs difference), so a
fast wrong config shows. Needs a CUDA device.

``--prefill``: one prefill launch of whole prompts (lengths uniform in
[128, 1024], as many as fit in ``--tokens`` packed rows: one
``--max-batch-tokens`` chunk of the bench job), sweeping the prefill tile's
rows (``PREFILL_ROWS`` 64, 128, 256: query rows x the heads sharing a KV head;
a taller tile reads each K/V tile for more queries), ``PREFILL_BLOCK_N``,
``PREFILL_WARPS`` and ``PREFILL_STAGES`` (no splits); its floor is the
larger of the causal flops (QK and PV, 4 x causal pairs x heads x head_dim)
over the bf16 matmul rate measured in the same run, and the Q/K/V/output
bytes over the copy bandwidth.

``--order`` (twenty-first session): whether the decode launch's time above its floor
is load imbalance (contexts from 129 to 1,152 keys, ~4 programs per SM at 64 rows):
the default launch with its tiles in batch order, longest context first, dispatched
heads first, both, and a batch of equal contexts with the same total keys.
"""
import argparse
import itertools
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mlora.kernels import paged_attention as pa  # noqa: E402
from mlora.bench.kernels import measure_ceilings  # noqa: E402

H, HKV, D, PAGE = 32, 8, 128, 16


def shuffled_tables(lens: list[int], gen: torch.Generator) -> tuple[list[list[int]], int]:
    """Block tables of sequences of ``lens`` tokens over all pages in a seeded random order."""
    pages = [-(-n // PAGE) for n in lens]
    perm = torch.randperm(sum(pages), generator=gen).tolist()
    tables, at = [], 0
    for p in pages:
        tables.append(perm[at : at + p])
        at += p
    return tables, sum(pages)


def prefill_case(tokens: int, gen: torch.Generator):
    """Whole prompts packed up to ``tokens`` rows: layout, lengths, pages."""
    lens = []
    while True:
        n = int(torch.randint(128, 1025, (1,), generator=gen))
        if sum(lens) + n > tokens:
            break
        lens.append(n)
    tables, num_pages = shuffled_tables(lens, gen)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return starts, lens, tables, num_pages


def sweep_prefill(tokens: int, quick: bool, bw: float, rate: float, gen: torch.Generator) -> None:
    starts, lens, tables, num_pages = prefill_case(tokens, gen)
    T = sum(lens)
    k = torch.randn(num_pages, PAGE, HKV, D, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(num_pages, PAGE, HKV, D, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(T, H, D, generator=gen).to("cuda", torch.bfloat16)
    pairs = sum(n * (n + 1) // 2 for n in lens)
    flop_us = 4 * pairs * H * D / rate * 1e6
    byte_us = (2 * T * H * D + 2 * T * HKV * D) * 2 / bw * 1e6  # q and out; K and V once
    floor_us = max(flop_us, byte_us)
    print(f"prefill: {len(lens)} prompts, {T} rows, matmul {rate / 1e12:.0f} TFLOP/s: flop floor {flop_us:.1f} us, "
          f"byte floor {byte_us:.1f} us")
    layouts = {}  # query rows x heads of one prefill tile -> the tile lists (built per tile size)
    saved_rows = pa.PREFILL_ROWS
    for rows in (64, 128, 256):
        pa.PREFILL_ROWS = rows
        layouts[rows] = pa.PagedLayout.build(starts, lens, tables, H // HKV, torch.device("cuda"))
    pa.PREFILL_ROWS = saved_rows
    ref = pa.paged_attention(q, k, v, layouts[saved_rows], D**-0.5).float()
    results = []
    saved = saved_rows, pa.PREFILL_BLOCK_N, pa.PREFILL_WARPS, pa.PREFILL_STAGES
    for rows, bn, w, st in itertools.product(layouts, [32, 64, 128], [4, 8],
                                             [None, 2, 3] if quick else [None, 1, 2, 3, 4]):
        pa.PREFILL_BLOCK_N, pa.PREFILL_WARPS, pa.PREFILL_STAGES = bn, w, st
        layout = layouts[rows]
        out = torch.full_like(q, float("nan"))
        try:
            pa.paged_attention(q, k, v, layout, D**-0.5, out=out)
            err = (out.float() - ref).abs().max().item()
            us = 1e3 * triton.testing.do_bench_cudagraph(
                lambda: pa.paged_attention(q, k, v, layout, D**-0.5, out=out), rep=30)
        except Exception as e:  # shared memory or registers out of range: reported, not fatal
            print(f"  tile rows {rows:3d} block_n {bn:3d} warps {w} stages {st}: failed ({type(e).__name__})")
            continue
        results.append((us, rows, bn, w, st, err))
    _, pa.PREFILL_BLOCK_N, pa.PREFILL_WARPS, pa.PREFILL_STAGES = saved
    for us, rows, bn, w, st, err in sorted(results):
        mark = "  (default)" if (rows, bn, w, st) == saved else ""
        print(f"    tile rows {rows:3d} block_n {bn:3d} warps {w} stages {str(st):4s}: {us:7.1f} us = "
              f"{us / floor_us:.2f}x floor, max |diff| {err:.1e}{mark}")


def layout_for(rows: int, gen: torch.Generator):
    ctx = torch.randint(129, 1153, (rows,), generator=gen).tolist()
    tables, num_pages = shuffled_tables(ctx, gen)
    layout = pa.PagedLayout.build(list(range(rows + 1)), ctx, tables, H // HKV, torch.device("cuda"))
    return layout, ctx, num_pages


def decode_case(rows: int, bw: float, gen: torch.Generator):
    """One decode batch of ``rows`` sequences: (layout, contexts, q, K, V, K/V byte floor in us,
    the default launch's output unsplit as the reference)."""
    layout, ctx, num_pages = layout_for(rows, gen)
    k = torch.randn(num_pages, PAGE, HKV, D, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(num_pages, PAGE, HKV, D, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(rows, H, D, generator=gen).to("cuda", torch.bfloat16)
    floor_us = 2 * sum(ctx) * HKV * D * 2 / bw * 1e6
    ref = pa.paged_attention(q, k, v, layout, D**-0.5, splits_override=1).float()
    return layout, ctx, q, k, v, floor_us, ref


def sweep_order(rows: int, bw: float, gen: torch.Generator) -> None:
    """The default decode launch over one batch in four dispatch orders, and over a batch of
    equal contexts with the same keys (what a perfectly balanced launch would take)."""
    layout, ctx, q, k, v, floor_us, ref = decode_case(rows, bw, gen)
    (decode,) = layout.launches
    seq0, q00 = decode.tile_seq.clone(), decode.tile_q0.clone()
    longest = torch.argsort(torch.tensor(ctx, device="cuda")[seq0.long()], descending=True, stable=True)
    print(f"{rows} rows, mean context {sum(ctx) / rows:.0f} (max {max(ctx)}): floor {floor_us:.1f} us")
    for label, sort, heads_first in (("tiles in batch order", False, False), ("longest first", True, False),
                                     ("heads first", False, True), ("longest first, heads first", True, True)):
        decode.tile_seq = seq0[longest].contiguous() if sort else seq0
        decode.tile_q0 = q00[longest].contiguous() if sort else q00
        decode.heads_first = heads_first
        for sp in (1, 2):
            out = torch.full_like(q, float("nan"))
            pa.paged_attention(q, k, v, layout, D**-0.5, out=out, splits_override=sp)
            err = (out.float() - ref).abs().max().item()
            us = 1e3 * triton.testing.do_bench_cudagraph(
                lambda: pa.paged_attention(q, k, v, layout, D**-0.5, out=out, splits_override=sp), rep=50)
            print(f"  {label:28s} splits {sp}: {us:6.1f} us = {us / floor_us:.2f}x floor, max |diff| {err:.1e}")
    decode.heads_first = False
    mean = round(sum(ctx) / rows)
    tables, pages = shuffled_tables([mean] * rows, gen)
    even = pa.PagedLayout.build(list(range(rows + 1)), [mean] * rows, tables, H // HKV, torch.device("cuda"))
    k = torch.randn(pages, PAGE, HKV, D, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(pages, PAGE, HKV, D, generator=gen).to("cuda", torch.bfloat16)
    out = torch.empty_like(q)
    us = 1e3 * triton.testing.do_bench_cudagraph(lambda: pa.paged_attention(q, k, v, even, D**-0.5, out=out,
                                                                            splits_override=1), rep=50)
    even_floor = 2 * mean * rows * HKV * D * 2 / bw * 1e6
    print(f"  equal contexts ({mean} each)      splits 1: {us:6.1f} us = {us / even_floor:.2f}x its floor "
          f"({even_floor:.1f} us)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--quick", action="store_true", help="fewer combinations")
    ap.add_argument("--prefill", action="store_true", help="sweep a prefill launch instead of decode")
    ap.add_argument("--tokens", type=int, default=8192, help="packed prefill rows (--prefill)")
    ap.add_argument("--order", action="store_true",
                    help="decode dispatch orders (batch order, longest context first, heads first) and equal contexts")
    args = ap.parse_args()
    ceil = measure_ceilings()  # the copy bandwidth and bf16 matmul rate of mlora bench kernels
    bw = ceil.copy_bytes_per_s
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    gen = torch.Generator().manual_seed(0)
    if args.prefill:
        sweep_prefill(args.tokens, args.quick, bw, ceil.bf16_flops_per_s, gen)
        return
    if args.order:
        for rows in (int(r) for r in args.rows.split(",")):
            sweep_order(rows, bw, gen)
        return
    block_ns = [32, 64, 128]
    warps = [4, 8] if args.quick else [2, 4, 8]
    stages = [None, 2, 4] if args.quick else [None, 1, 2, 3, 4]
    splits = [1, 2, 4, 8]
    for rows in (int(r) for r in args.rows.split(",")):
        layout, ctx, q, k, v, floor_us, ref = decode_case(rows, bw, gen)
        print(f"{rows} rows, mean context {sum(ctx) / rows:.0f}: K+V {2 * sum(ctx) * HKV * D * 2 / 1e6:.1f} MB, "
              f"floor {floor_us:.1f} us")
        results = []
        saved = pa.DECODE_BLOCK_N, pa.DECODE_WARPS, pa.DECODE_STAGES
        for bn, w, st, sp in itertools.product(block_ns, warps, stages, splits):
            pa.DECODE_BLOCK_N, pa.DECODE_WARPS, pa.DECODE_STAGES = bn, w, st
            out = torch.full_like(q, float("nan"))
            try:
                pa.paged_attention(q, k, v, layout, D**-0.5, out=out, splits_override=sp)
                err = (out.float() - ref).abs().max().item()
                us = 1e3 * triton.testing.do_bench_cudagraph(
                    lambda: pa.paged_attention(q, k, v, layout, D**-0.5, out=out, splits_override=sp), rep=30)
            except Exception as e:  # a config that does not compile (shared memory) is reported, not fatal
                print(f"  block_n {bn:3d} warps {w} stages {st} splits {sp}: failed ({type(e).__name__})")
                continue
            results.append((us, bn, w, st, sp, err))
        pa.DECODE_BLOCK_N, pa.DECODE_WARPS, pa.DECODE_STAGES = saved
        results.sort()
        default = [r for r in results if (r[1], r[2], r[3]) == saved]  # the module's decode defaults, every split
        for label, rs in (("fastest", results[:12]), ("default launch parameters", default)):
            print(f"  {label}:")
            for us, bn, w, st, sp, err in rs:
                print(f"    block_n {bn:3d} warps {w} stages {str(st):4s} splits {sp}: {us:7.1f} us "
                      f"= {us / floor_us:.2f}x floor, max |diff| {err:.1e}")


if __name__ == "__main__":
    main()
