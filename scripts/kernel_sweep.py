"""Launch-config variants of the segmented shrink + expand on a few step-2 shapes,
each timed the way `mlora bench kernels` times a case (one call captured in a
CUDA graph, replayed after a 256 MiB L2 flush, CUDA events, median of 30), and
checked against the float64 reference. How the defaults of
mlora.kernels.triton_sgmv.launch_config were chosen. Needs a CUDA GPU:

    PYTHONPATH=. python scripts/kernel_sweep.py [--defaults | --split | --fused | --decode [--split | --shrink] | --mixed
                                                 | --prefill | --silu | --misses]

Each line: the case (d_out / rank / T / adapters), its floor in µs, then µs per
variant ("default" is the current launch_config; the others override entries).
``--split``: the default two-launch config only, and where its time goes: the
same graph with the expand launch left out (``shrink_only``, output not
checked) and with neither launch (``empty``: the graph replay and the events
themselves).
``--fused``: every launch-bound case of `mlora bench kernels` (floor < 10 µs,
T <= 256) with the fused launch forced on and off and its variants, next to
the selection rule's choice (``rule``) and its redundant-A estimate
(``a_MiB``): the data to calibrate FUSED_MAX_ROWS and FUSED_MAX_A_BYTES in
mlora.kernels.triton_fused.
``--decode``: the four LoRA launches of one Llama-3-8B decoder layer in the
engine's decode step (q/k/v, o, gate/up from d_in 4096; down from d_in 14336;
rank 16; 256 running rows over 64 and over 8 adapters, step 7's shapes) with
the expand and shrink knobs that decide how many bytes are in flight, then per
variant the layer's sum and 32 layers of it, to set against the decode
profile's LoRA time (eleventh session: 5.8 ms of a 64-adapter iteration).
With ``--split`` as well: the default's layer time split into the shrinks alone and the empty
graph (where the fixed cost per launch pair sits).
With ``--shrink`` instead: the shrinks alone under the shrink's knobs (K block, stages, waves of
split-K, the final sum's chunk, warps), the expand not launched, plus the default with its expand
(``default_full``).
``--mixed``: `mlora bench kernels`' mixed-rank cases (ranks 8/16/64 in one rank-64 bank) and
their padded twins (every slot rank 64), every variant on a rank-pitched B bank (the engine's
layout) but ``padded_layout``: the shrink's rank tile, the expand's column groups, tiles and
warps, and the split (with ``--split``: the default's shrink alone and the empty graph), then
per variant the mixed / padded time ratio of each case (issue step 2's target: at most 0.6),
against the padded default and against the padded variant.
``--prefill``: the four LoRA launches of one decoder layer in an 8,192-token prefill chunk (the
engine's prefill iterations; rank 16, 8 and 2 adapters) with the row tile (``block_m*``), the
expand's column tile, warps and column groups; then per variant the layer's sum.
``--misses``: 15 of issue step 2's launch-bound misses (``bench.LAUNCH_BOUND_MISSES``: floor under
10 µs, over 12 µs in the eighteenth session's grid) under taller row tiles (``block_m*``: 14 of them
are one adapter at T 256 / 1024, where every 16-row tile rereads the slot's A), split-K, waves,
column groups and the fused launch forced on or off; then per variant how many land within 12 µs.
``--silu``: the gate/up LoRA and the SiLU product at decode (256 rows, 64 and 8 adapters) and
prefill (8,192 rows, 8 adapters) sizes, rank 16, rank-pitched B: the plain path (shrink +
expand, then the SiLU kernel) against the fused one (``mlora.kernels.triton_act``) with 1, 2,
4 and 8 column tiles per program (``silu_group_tiles``); outputs checked against the plain
path's.
"""
import json
import statistics
import sys

import torch

from mlora.kernels import build_plan, to_rank_pitched
from mlora.kernels import triton_fused as fused
from mlora.kernels import triton_sgmv as sgmv
from mlora.bench.kernels import (ADAPTERS, D_IN, LAUNCH_BOUND_MISSES, MIXED_CASES, OUTPUTS, RANKS, NoLaunch, _events_median, captured_plan,
                                 case_floor, graph_of, make_case, measure_ceilings, reference_f64)
from mlora.kernels.triton_sgmv import add_lora_slices_triton

CASES = [("4096", 8, 1, 1), ("4096", 16, 16, 8), ("4096", 16, 64, 64), ("4096", 16, 256, 64), ("4096", 8, 256, 256),
         ("4096", 16, 1024, 64), ("4096", 64, 256, 64), ("4096", 64, 1024, 1), ("4096", 64, 1024, 8),
         ("4096", 64, 4096, 1), ("4096", 8, 4096, 64), ("4096", 16, 4096, 64), ("14336", 16, 64, 8),
         ("14336", 16, 256, 64), ("14336", 64, 256, 1), ("14336", 64, 1024, 1), ("14336", 64, 4096, 256),
         ("qkv", 16, 256, 64), ("qkv", 64, 64, 64), ("qkv", 64, 1024, 1), ("qkv", 16, 1024, 64),
         ("4096", "mixed", 256, 64)]
VARIANTS = {"default": {}, "no_pdl": dict(pdl=False), "waves4": dict(waves=4), "waves8": dict(waves=8),
            "group1": dict(group_tiles=1), "group2": dict(group_tiles=2), "block_n64": dict(block_n=64),
            "block_n32": dict(block_n=32),  # 60 expand registers at rank 16 against 158 at 128 (8 programs/SM, not 3)
            "block_n128": dict(block_n=128),
            # 16-wide shrink rank tiles in a 64-wide bank: a rank-64 slot's shrink in 4 programs, a
            # rank-8/16 slot's in 1 (the mixed-rank case against its padded twin, issue step 2)
            "block_r16": dict(block_r=16),
            "expand_warps8": dict(expand_warps=8), "expand_warps2": dict(expand_warps=2), "sum_chunk4": dict(sum_chunk=4),
            "split1": dict(split=1),
            "split4": dict(split=4), "shrink_warps4": dict(shrink_warps=4), "shrink_warps8": dict(shrink_warps=8),
            "fused": dict(fused=True), "two_launch": dict(fused=False)}
if "--defaults" in sys.argv:
    VARIANTS = {"default": {}}
SPLIT = "--split" in sys.argv
if SPLIT:
    VARIANTS = {"default": dict(fused=False)}
FUSED = "--fused" in sys.argv
DECODE = "--decode" in sys.argv
PREFILL = "--prefill" in sys.argv
MIXED = "--mixed" in sys.argv
# the engine's fused slices beyond the bench grid's outputs, and their d_in where it is not 4096
SWEEP_OUTPUTS = {**OUTPUTS, "gateup": (14336, 14336), "down": (4096,)}
SWEEP_D_IN = {"down": 14336}
if DECODE:
    CASES = [(o, 16, 256, A) for A in (64, 8) for o in ("qkv", "4096", "gateup", "down")]
if DECODE and not SPLIT:  # with --split: the default's time split into shrink alone and the empty graph
    VARIANTS = {"default": {},
                "expand_warps2": dict(expand_warps=2), "expand_warps8": dict(expand_warps=8),
                "expand_stages1": dict(expand_stages=1), "expand_stages3": dict(expand_stages=3),
                "group1": dict(group_tiles=1), "group2": dict(group_tiles=2), "group4": dict(group_tiles=4),
                "block_n32": dict(block_n=32), "block_n128": dict(block_n=128), "waves4": dict(waves=4),
                "split1": dict(split=1), "shrink_warps4": dict(shrink_warps=4), "shrink_warps8": dict(shrink_warps=8),
                "no_pdl": dict(pdl=False),
                # nineteenth session: waves4 won at 64 adapters and lost at 8, where its programs
                # walk 4 K-blocks; a floor on the K-blocks per program kept both sides here
                # (twentieth session) but not in bench batch or the grid (BENCHMARKS.md)
                "waves4_min8": dict(waves=4, min_k_blocks=8), "waves4_min12": dict(waves=4, min_k_blocks=12),
                "waves3_min8": dict(waves=3, min_k_blocks=8)}
SHRINK = "--shrink" in sys.argv
MISSES = "--misses" in sys.argv
if MISSES:  # issue step 2's launch-bound misses (bench.LAUNCH_BOUND_MISSES) under taller row tiles and more
    CASES = list(LAUNCH_BOUND_MISSES)
    VARIANTS = {"default": {}, "block_m16": {"__block_m": 16}, "block_m32": {"__block_m": 32},
                "block_m64": {"__block_m": 64}, "block_m64_block_n128": {"__block_m": 64, "block_n": 128},
                "split1": dict(split=1), "waves4": dict(waves=4), "group1": dict(group_tiles=1),
                "fused": dict(fused=True), "two_launch": dict(fused=False)}
if DECODE and SHRINK:  # the decode layer's shrinks alone (expand not launched, output not checked) per shrink knob
    VARIANTS = {name: {**cfg, "__skip": ("_expand_kernel",), "fused": False} for name, cfg in {
        "default": {}, "block_k64": dict(block_k=64), "block_k256": dict(block_k=256),
        "stages2": dict(shrink_stages=2), "stages3": dict(shrink_stages=3), "stages6": dict(shrink_stages=6),
        "waves1": dict(waves=1), "waves4": dict(waves=4), "waves8": dict(waves=8),
        "sum_chunk4": dict(sum_chunk=4), "sum_chunk16": dict(sum_chunk=16),
        "waves8_chunk16": dict(waves=8, sum_chunk=16), "shrink_warps2": dict(shrink_warps=2),
        "shrink_warps8": dict(shrink_warps=8),
        # nineteenth session: more bytes in flight per program (512-wide K blocks: 32 KiB of A and
        # x per stage), with the split-K chain (partials, arrival atomic, last program's sum) or
        # without it (split 1: one program per tile and slice streams the whole of A)
        "block_k512": dict(block_k=512), "block_k512_warps4": dict(block_k=512, shrink_warps=4),
        "split1_block_k512": dict(split=1, block_k=512),
        "split1_block_k512_warps4": dict(split=1, block_k=512, shrink_warps=4),
        "split1_block_k256_warps4": dict(split=1, block_k=256, shrink_warps=4),
        "block_k256_stages6": dict(block_k=256, shrink_stages=6),
        "waves4_min8": dict(waves=4, min_k_blocks=8), "waves4_min12": dict(waves=4, min_k_blocks=12)}.items()}
    VARIANTS["default_full"] = {}
if PREFILL:  # one decoder layer's four LoRA launches in an 8,192-token prefill chunk over few adapters
    CASES = [(o, 16, 8192, A) for A in (8, 2) for o in ("qkv", "4096", "gateup", "down")]
    VARIANTS = {"default": {}, "block_m16": {"__block_m": 16}, "block_m64": {"__block_m": 64},
                "block_n128": dict(block_n=128), "block_n32": dict(block_n=32),
                "expand_warps8": dict(expand_warps=8), "expand_warps2": dict(expand_warps=2),
                "group2": dict(group_tiles=2), "group4": dict(group_tiles=4),
                "block_m64_block_n128": {"__block_m": 64, "block_n": 128}}
if MIXED:  # bench kernels' mixed-rank cases (ranks 8/16/64 in a rank-64 bank) and their padded twins
    CASES = [(o, r, T, A) for T, A, o in MIXED_CASES for r in ("mixed", 64)]
if MIXED and not SPLIT:  # with --split: the default's time split into shrink alone and the empty graph
    # every variant reads a rank-pitched B bank (the engine's layout, mlora.kernels.pitch; the same
    # bytes as the padded layout for the rank-64 twins) except padded_layout
    VARIANTS = {"default": {}, "padded_layout": {"__padded": True},
                "expand_stages2": dict(expand_stages=2),
                "block_r16": dict(block_r=16), "block_r32": dict(block_r=32),
                "group1": dict(group_tiles=1), "group2": dict(group_tiles=2), "group4": dict(group_tiles=4),
                "expand_waves8": dict(expand_waves=8), "expand_waves16": dict(expand_waves=16),
                "waves4": dict(waves=4), "split1": dict(split=1), "block_n64": dict(block_n=64),
                "block_n32": dict(block_n=32), "expand_warps8": dict(expand_warps=8),
                "expand_stages3": dict(expand_stages=3), "block_r16_group2": dict(block_r=16, group_tiles=2)}
if FUSED:
    CASES = [(o, r, T, A) for o in OUTPUTS for r in RANKS for T in (1, 16, 64, 256) for A in ADAPTERS if A <= T]
    VARIANTS = {"default": {}, "fused": dict(fused=True), "two_launch": dict(fused=False),
                "fused_group1": dict(fused=True, fused_group=1), "fused_group4": dict(fused=True, fused_group=4),
                "fused_block_n64": dict(fused=True, fused_block_n=64),
                "fused_block_n32": dict(fused=True, fused_block_n=32), "fused_warps8": dict(fused=True, fused_warps=8),
                "fused_stages2": dict(fused=True, fused_stages=2)}
LAUNCH_BOUND_S = 10e-6  # the bench's launch-bound cases: memory floor below this


def graph_median(graph, flush, reps=30):
    """Median µs of ``reps`` replays of ``graph``, each after an L2 flush (the bench's timer)."""
    return _events_median(graph.replay, reps, flush) * 1e6


def fused_summary(rows: list[dict], target_us: float = 12.0) -> str:
    """What the fused calibration decides (``--fused``): per launch-bound case the two-launch and
    fused times and the rule's choice; how many cases meet issue step 2's 12 us with each, and
    how often the rule picks the faster path. Cases with a WRONG variant are counted apart."""
    ok = [r for r in rows if isinstance(r.get("fused"), float) and isinstance(r.get("two_launch"), float)]
    bad = len(rows) - len(ok)
    if not ok:
        return f"fused calibration: no comparable case ({bad} with a wrong or missing variant)"
    ruled = [r["fused"] if r["rule"] == "fused" else r["two_launch"] for r in ok]
    best = [min(r["fused"], r["two_launch"]) for r in ok]
    right = sum((r["fused"] <= r["two_launch"]) == (r["rule"] == "fused") for r in ok)
    cost = [r["fused"] / r["two_launch"] for r in ok if r["rule"] == "fused"]
    geo = statistics.geometric_mean(cost) if cost else float("nan")
    faster = sum(r["fused"] < r["two_launch"] for r in ok)
    return (f"fused calibration over {len(ok)} launch-bound cases ({bad} not comparable): <= {target_us:g} us with two "
            f"launches {sum(r['two_launch'] <= target_us for r in ok)}, fused {sum(r['fused'] <= target_us for r in ok)}, "
            f"the rule's choice {sum(t <= target_us for t in ruled)}, the better of the two {sum(t <= target_us for t in best)}; "
            f"the rule picks the faster path in {right} of {len(ok)}; fused is faster in {faster} of {len(ok)}; where the "
            f"rule picks fused ({len(cost)} cases) fused takes {geo:.2f}x the two-launch time in geometric mean (below 1: "
            f"faster). FUSED_BY_DEFAULT = True is supported when the rule's count beats the "
            f"two-launch count and the rule is right in most cases.")


def main():
    ceil = measure_ceilings()
    rows = []
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for o, r, T, A in CASES:
        widths, d_in = SWEEP_OUTPUTS[o], SWEEP_D_IN.get(o, D_IN)
        ranks_per_slot = [(8, 16, 64)[i % 3] for i in range(A)] if r == "mixed" else [r] * A
        y0, x, a, b, rs, ranks, scales = make_case(T, A, widths, ranks_per_slot, max(ranks_per_slot), d_in=d_in)
        static = captured_plan(build_plan(rs), A)
        floor = case_floor(T, widths, ranks_per_slot, torch.unique(rs).tolist(), ceil, d_in=d_in)["floor_s"] * 1e6
        if FUSED and floor >= LAUNCH_BOUND_S * 1e6:
            continue
        ref = reference_f64(y0, x, a, b, rs, ranks, scales, widths)
        row = {"case": f"{o}/r{r}/T{T}/A{A}", "floor_us": round(floor, 1)}
        if FUSED:
            rule = fused.fused_config(static.tile_capacity, static.row_capacity, max(ranks_per_slot), d_in, widths,
                                      a.element_size(), a.device)
            row.update(rule="fused" if rule["rule"] else "two_launch", a_MiB=round(rule["a_bytes"] / 2**20, 1))
        variants = dict(VARIANTS)
        if SPLIT:
            variants.update(shrink_only={"__skip": ("_expand_kernel",), "fused": False},
                            empty={"__skip": ("_shrink_kernel", "_expand_kernel"), "fused": False})
        for name, cfg in variants.items():
            skip = cfg.get("__skip", ()) if cfg else ()
            pitched = bool(cfg and cfg.get("__pitched")) or (MIXED and not (cfg and cfg.get("__padded")))
            block_m = cfg.get("__block_m") if cfg else None
            cfg = {k: v for k, v in (cfg or {}).items() if k not in ("__skip", "__pitched", "__padded", "__block_m")}
            saved = {k: getattr(sgmv, k) for k in skip}
            for k in skip:
                setattr(sgmv, k, NoLaunch())
            try:
                bank = to_rank_pitched(b, ranks, widths) if pitched else b
                plan = static
                if block_m is not None:  # the same rows in tiles of another height
                    plan = captured_plan(build_plan(rs), A, block_m)
                row[name] = _time_variant(y0, x, a, bank, plan, ranks, scales, widths, cfg, ref, flush,
                                          check=not skip, pitched=pitched)
            except Exception as exc:  # a variant this case cannot take (e.g. the fused launch forced on a large T)
                row[name] = f"FAILED ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})"
            finally:
                for k, v in saved.items():
                    setattr(sgmv, k, v)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if FUSED:
        print(fused_summary(rows), flush=True)
    if PREFILL:
        for line in decode_summary(rows, list(VARIANTS), label="prefill chunk layer"):
            print(line, flush=True)
    if DECODE:
        for line in decode_summary(rows, list(VARIANTS) + (["shrink_only", "empty"] if SPLIT else [])):
            print(line, flush=True)
    if MIXED and not SPLIT:
        for line in mixed_summary(rows):
            print(line, flush=True)
    if MISSES:
        print(misses_summary(rows), flush=True)


def misses_summary(rows: list[dict], target_us: float = 12.0) -> str:
    """``--misses``: per variant how many cases land within ``target_us`` (issue step 2's
    launch-bound target), and how many the best variant per case lands."""
    counts = {name: sum(isinstance(r.get(name), float) and r[name] <= target_us for r in rows) for name in VARIANTS}
    best = sum(min((r[n] for n in VARIANTS if isinstance(r.get(n), float)), default=float("inf")) <= target_us
               for r in rows)
    return (f"within {target_us:g} us of {len(rows)}: " + ", ".join(f"{k} {v}" for k, v in counts.items())
            + f"; the best variant per case: {best}")


def mixed_summary(rows: list[dict]) -> list[str]:
    """Per variant of ``--mixed``: each case's mixed time over the padded twin's default time
    and over the padded twin's time under the same variant (a WRONG time shows as such)."""
    by_case = {r["case"]: r for r in rows}
    out = []
    for name in VARIANTS:
        parts = []
        for case, m in by_case.items():
            if "/rmixed/" not in case:
                continue
            p = by_case.get(case.replace("/rmixed/", "/r64/"), {})
            mv, pd, pv = m.get(name), p.get("default"), p.get(name)
            if not all(isinstance(t, float) for t in (mv, pd, pv)):
                parts.append(f"{case} WRONG or missing")
                continue
            parts.append(f"{case} {mv / pd:.2f} ({mv / pv:.2f})")
        out.append(f"mixed / padded default (/ padded {name}), {name}: " + "; ".join(parts))
    return out


def decode_summary(rows: list[dict], names=None, layers: int = 32, label: str = "decode layer") -> list[str]:
    """Per adapter count of ``--decode``: the floor and each variant's time summed over one
    layer's four launches, and times ``layers`` (the decode iteration's LoRA share); a variant
    WRONG in any launch is reported as such."""
    out = []
    for A in sorted({int(r["case"].rsplit("/A", 1)[1]) for r in rows}, reverse=True):
        group = [r for r in rows if r["case"].endswith(f"/A{A}")]
        floor = sum(r["floor_us"] for r in group)
        parts = []
        for name in names or VARIANTS:
            times = [r.get(name) for r in group]
            if all(isinstance(t, float) for t in times):
                parts.append(f"{name} {sum(times):.1f} us ({sum(times) * layers / 1e3:.2f} ms, {sum(times) / floor:.1f}x)")
            else:
                parts.append(f"{name} WRONG or missing")
        out.append(f"{label}, {A} adapters, {len(group)} launches: floor {floor:.1f} us "
                   f"({floor * layers / 1e3:.2f} ms per {layers} layers); " + "; ".join(parts))
    return out


def _time_variant(y0, x, a, b, static, ranks, scales, widths, cfg, ref, flush, check=True, pitched=False):
    """Median µs of one captured call (or "WRONG ..." when checked and not within 1e-2)."""
    y = y0.clone()
    call = lambda: add_lora_slices_triton(y, x, a, b, static, ranks, scales, widths, config=cfg or None,  # noqa: E731
                                          b_pitched=pitched)
    graph = graph_of(call)
    y.copy_(y0)
    graph.replay()
    torch.cuda.synchronize()
    err = float((y.double() - ref).abs().max() / ref.abs().max()) if check else 0.0
    return round(graph_median(graph, flush), 1) if err < 1e-2 else f"WRONG (rel err {err:.2e})"

def silu_main():
    """``--silu`` (module docstring)."""
    from mlora.kernels.elementwise import silu_mul_triton
    from mlora.kernels.triton_act import lora_silu_mul_triton

    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    inter = 14336
    for T, A in ((256, 64), (256, 8), (8192, 8)):
        y0, x, a, b, rs, ranks, scales = make_case(T, A, (inter, inter), [16] * A, 16)
        b = to_rank_pitched(b, ranks, [inter, inter])
        static = captured_plan(build_plan(rs), A)
        gu = y0.clone()
        outs = {}
        calls = {"plain": lambda: outs.__setitem__("plain", silu_mul_triton(add_lora_slices_triton(
            gu.copy_(y0), x, a, b, static, ranks, scales, [inter, inter], config={"fused": False}, b_pitched=True),
            inter))}
        for g in (1, 2, 4, 8):
            calls[f"fused_group{g}"] = lambda g=g: outs.__setitem__(f"fused_group{g}", lora_silu_mul_triton(
                y0, x, a, b, static, ranks, scales, inter, config={"silu_group_tiles": g}, b_pitched=True))
        row = {"case": f"gateup+silu/r16/T{T}/A{A}"}
        for name, call in calls.items():
            graph = graph_of(call)
            graph.replay()
            torch.cuda.synchronize()
            ref = outs["plain"].float()
            err = float((outs[name].float() - ref).abs().max() / ref.abs().max())
            row[name] = round(graph_median(graph, flush), 1) if err < 1e-2 else f"WRONG (rel err {err:.2e})"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    if "--silu" in sys.argv:
        silu_main()
        sys.exit(0)
    main()
