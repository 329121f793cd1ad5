"""``mlora bench ...``: benchmark commands whose output goes into BENCHMARKS.md.

Every figure is printed with its physical floor beside it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from mlora.bench.hash import run_hash_bench
from mlora.cli.render import fail

bench_app = typer.Typer(help="Benchmarks (results belong in BENCHMARKS.md).", no_args_is_help=True,
                        rich_markup_mode=None)  # plain help, as the app's (mlora.cli.app)


@bench_app.command("hash")
def bench_hash(
    paths: Optional[List[Path]] = typer.Argument(None, exists=True, help="Adapter directories or collections."),
    base: Optional[Path] = typer.Option(None, "--base", exists=True, file_okay=False, help="A base checkpoint to hash too."),
    runs: int = typer.Option(5, "--runs", min=1, help="Timed runs per tool (median reported)."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, help="mlora hashing threads (default: all cores)."),
    json_out: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Time `mlora hash` against coreutils `sha256sum` over the same files (warm cache, medians)."""
    if not paths and base is None:
        raise typer.BadParameter("give adapter PATHs and/or --base DIR")
    results = run_hash_bench([str(p) for p in paths or []], str(base) if base else None, runs, workers)
    if json_out:
        sys.stdout.write(json.dumps(results, indent=2) + "\n")
        return
    table = Table(title="mlora hash vs sha256sum (median wall time, warm page cache)", title_justify="left")
    for col in ("workload", "bytes", "sha256sum", "mlora", "speedup", "mlora peak RSS", "floor (hashlib x cores)"):
        table.add_column(col, justify="right")
    gb = 1e9
    for r in results:
        table.add_row(
            r["workload"],
            f"{r['bytes'] / gb:.2f} GB",
            f"{r['sha256sum']['median_s']:.2f} s ({r['sha256sum_bytes_per_s'] / gb:.2f} GB/s)",
            f"{r['mlora']['median_s']:.2f} s ({r['mlora_bytes_per_s'] / gb:.2f} GB/s)",
            f"{r['speedup']:.2f}x",
            f"{r['mlora']['peak_rss_bytes'] / 2**20:.0f} MiB",
            f"{r['floor_s']:.2f} s ({r['cores']} cores x {r['single_core_sha256_bytes_per_s'] / gb:.2f} GB/s)",
        )
    Console().print(table)


@bench_app.command("kernels")
def bench_kernels(
    quick: bool = typer.Option(False, "--quick", help="Token counts 1, 64, 256, 4096 only."),
    baselines: bool = typer.Option(True, "--baselines/--no-baselines", help="Also time the loop and gather-BMM baselines."),
    json_out: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON results to this file."),
) -> None:
    """Time the segmented Triton kernels against their floors and baselines on the GPU."""
    from mlora.bench.kernels import run_kernel_bench

    err = Console(stderr=True)
    _check_options(err, "cuda")  # the kernels run on a GPU only

    def progress(c):
        err.print(
            f"[dim]{c['d_out']:>6} r{c['R']:<3} T={c['T']:<5} A={c['adapters']:<4} "
            f"graph {c['triton_graph_s'] * 1e6:8.1f} us  floor {c['floor_s'] * 1e6:8.1f} us  "
            f"{'ok' if c['correct'] else 'WRONG'}[/dim]"
        )

    try:
        results = run_kernel_bench(quick=quick, baselines=baselines, progress=None if json_out else progress)
    except RuntimeError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1)
    if not _save(results, out, json_out):
        _print_kernel_tables(results)
    if not results["summary"]["all_correct"]:
        raise typer.Exit(1)


def _progress_line(err: Console):
    """A benchmark's progress callback: one dim, unwrapped line on stderr per message (scripts grep them)."""
    return lambda m: err.print(f"[dim]{m}[/dim]", soft_wrap=True)


def _save(results: dict, out: Optional[Path], json_out: bool, indent: int | None = 2) -> bool:
    """Write ``results`` to ``--out`` if given; with ``--json`` print them on stdout and return True
    (the caller then prints no tables)."""
    text = json.dumps(results, indent=indent)
    if out:
        out.write_text(text + "\n")
    if json_out:
        sys.stdout.write(text + "\n")
    return json_out


def _usage(err: Console, message: str):
    """A usage error: ``Error: E_USAGE: message`` on stderr, exit 2 (README, Exit codes)."""
    fail(err, "E_USAGE", message, 2)


def _check_options(err: Console, device: str, preset: str | None = None, dtype: str | None = None) -> None:
    """Refuse (exit 2) a model shape, device or dtype the benchmark does not know, and
    ``--device cuda`` on a machine without CUDA, before any workspace is written."""
    import torch

    from mlora.bench.batch import PRESETS

    if preset is not None and preset not in PRESETS:
        _usage(err, f"--preset must be one of {', '.join(PRESETS)}, not {preset!r}")
    if dtype is not None and dtype not in ("bfloat16", "float16", "float32"):
        _usage(err, f"--dtype must be bfloat16, float16 or float32, not {dtype!r}")
    if device not in ("cuda", "cpu"):
        _usage(err, f"--device must be cuda or cpu, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        _usage(err, "--device cuda: no CUDA device here; use --device cpu (with --preset tiny)")


def _us(s) -> str:
    return "-" if s is None else f"{s * 1e6:.1f}"


def _print_kernel_tables(r: dict) -> None:
    con = Console()
    c = r["ceilings"]
    con.print(f"{r['device']}, torch {r['torch']}: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
              f"bf16 matmul {c['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s (measured in this run)")
    table = Table(title="shrink + expand, bf16, d_in 4096 (times in us)", title_justify="left")
    for col in ("d_out", "rank", "T", "adapters", "floor", "graph", "fraction", "eager", "loop", "gather-BMM", "ok"):
        table.add_column(col, justify="right")
    for x in r["cases"]:
        table.add_row(x["d_out"], str(x["R"]), str(x["T"]), str(x["adapters"]), _us(x["floor_s"]),
                      _us(x["triton_graph_s"]), f"{x['fraction']:.2f}", _us(x["triton_eager_s"]),
                      _us(x.get("loop_s")), _us(x.get("gather_bmm_s")), "yes" if x["correct"] else "NO")
    con.print(table)
    for m in r["mixed_rank"]:
        con.print(f"mixed ranks 8/16/64, d_out {m.get('d_out', '4096')}, T={m['T']}, {m['adapters']} adapters: "
                  f"{_us(m['mixed_s'])} us vs padded-to-64 {_us(m['padded_s'])} us = {m['ratio']:.2f}x (floor ratio "
                  f"{m['floor_ratio']:.2f}, mixed floor {_us(m.get('mixed_floor_s'))} us; rank-pitched B; padded B "
                  f"{_us(m.get('mixed_padded_layout_s'))} us)")
    con.print_json(data=r["summary"])


@bench_app.command("batch")
def bench_batch(
    preset: str = typer.Option("llama-3-8b", "--preset",
                               help="Model shape: llama-3-8b, llama-3-70b (needs --tensor-parallel-size 2 or more "
                                    "on 141 GB GPUs), mistral-7b, or tiny (CPU smoke test)."),
    rows: int = typer.Option(512, "--rows", min=1, help="Rows of the synthetic job."),
    adapters: str = typer.Option("0,1,8,64", "--adapters", help="Distinct-adapter counts to run (0 = base only)."),
    rank: int = typer.Option(16, "--rank", min=1, help="Rank of every random adapter (all linear modules)."),
    prompt_min: int = typer.Option(128, "--prompt-min", min=1, help="Shortest prompt (tokens)."),
    prompt_max: int = typer.Option(1024, "--prompt-max", min=1, help="Longest prompt (tokens)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1, help="Tokens generated per row (EOS ignored)."),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs", min=1, help="Running rows per iteration."),
    max_batch_tokens: int = typer.Option(8192, "--max-batch-tokens", min=1, help="Rows per iteration (prefill chunks)."),
    device: str = typer.Option("cuda", "--device", help="cuda or cpu."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16, float16 or float32."),
    seed: int = typer.Option(0, "--seed"),
    cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--no-cuda-graphs", help="Replay decode steps from CUDA graphs."),
    lookahead: bool = typer.Option(True, "--lookahead/--no-lookahead",
                                   help="batch-run's --lookahead: build each decode iteration's inputs during the one before."),
    repeat_base: bool = typer.Option(True, "--repeat-base/--no-repeat-base",
                                     help="With base (0) first among several counts: run it again last; ratios "
                                          "use the faster base run (a first run may pay lazy compiles)."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", min=1,
                                             help="Cut the model over this many ranks, one GPU each (gloo ranks on "
                                                  "the CPU); each rank generates its part of the weights."),
    adapters_dir: Optional[Path] = typer.Option(None, "--adapters-dir", file_okay=False,
                                                help="With --tensor-parallel-size: where the random adapters are "
                                                     "written as PEFT files, reused when they match (default: a "
                                                     "temporary directory)."),
    json_out: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON results to this file."),
) -> None:
    """Time `mlora batch-run`'s engine on a synthetic job: tokens/s and decode iterations against their floor."""
    from mlora.batch.errors import CodedError
    from mlora.bench.batch import BatchBenchOptions
    from mlora.bench.tpbatch import run_tp_batch_bench

    err = Console(stderr=True)
    try:
        counts = tuple(int(a) for a in adapters.split(","))
    except ValueError:
        raise typer.BadParameter("--adapters takes comma-separated integers, e.g. 0,1,8,64")
    _check_options(err, device, preset, dtype)
    opts = BatchBenchOptions(preset=preset, rows=rows, adapters=counts, rank=rank, prompt_min=prompt_min,
                             prompt_max=prompt_max, max_new_tokens=max_new_tokens, max_num_seqs=max_num_seqs,
                             max_batch_tokens=max_batch_tokens, device=device, dtype=dtype, seed=seed,
                             cuda_graphs=cuda_graphs, lookahead=lookahead, repeat_base=repeat_base,
                             tensor_parallel_size=tensor_parallel_size,
                             adapters_dir=str(adapters_dir) if adapters_dir else None)

    def progress(s):
        d = s["decode_full_batch"] or s["decode"]
        dd = s["decode"]
        err.print(f"[dim]{s['adapters']:>4} adapters{' (again)' if s.get('repeat') else ''}: {s['tokens_per_s']:9.1f} tok/s"
                  + (f", decode {d['median_s'] * 1e3:.2f} ms vs floor {d['median_floor_s'] * 1e3:.2f} ms (staged "
                     f"{d['median_staged_floor_s'] * 1e3:.2f})" if d else "")
                  + f"; wall {s['wall_s']:.1f} s = prefill {s['prefill']['seconds']:.1f} + decode "
                  + (f"{dd['total_s']:.1f} (slowest {dd['max_s'] * 1e3:.0f} ms, {s['chained_iterations']} of "
                     f"{dd['iterations']} chained)" if dd else "0")
                  + f" + {s['outside_iterations_s']:.1f} outside"
                  + (f"; all-reduces {d['median_all_reduce_s'] * 1e3:.2f} ms of the floor"
                     if d and d.get("median_all_reduce_s") is not None else "")
                  + (f"; collector {sum(s['gc']['gc_pause_seconds'].values()) * 1e3:.1f} ms in "
                     f"{sum(s['gc']['gc_collections'].values())} collections (longest {s['gc']['gc_pause_max_ms']:.1f})"
                     if s.get("gc") else "")
                  + (f"; full-batch decode at SM {k['sm_mhz_median']:.0f} MHz (lowest {k['sm_mhz_min']}), "
                     f"{k['power_w_median']:.0f} W, power-capped in {k['power_capped_share']:.0%} of samples"
                     if (k := s.get("clocks_full_batch")) else "") + "[/dim]", soft_wrap=True)

    try:
        results = run_tp_batch_bench(opts, progress=None if json_out else progress,
                                     note=None if json_out else _progress_line(err))
    except CodedError as exc:  # a combination that cannot run (a model part larger than a GPU, ...)
        fail(err, exc.code, exc.message, 2 if isinstance(exc, ValueError) else 1)
    except ValueError as exc:  # the options' own checks (prompt lengths against the preset's context)
        _usage(err, str(exc))
    if not _save(results, out, json_out):
        _print_batch_table(results)


def _print_batch_table(r: dict) -> None:
    con = Console()
    c, o = r["ceilings"], r["options"]
    m = r.get("machine") or {}
    where = f" on {m['host']}" + (f", GPU {m['gpu_uuid']}" if m.get("gpu_uuid") else "") if m.get("host") else ""
    k = m.get("clocks_after")
    if k:  # NVML's view after the scenarios (mlora.bench.gpuclocks.gpu_clocks)
        where += (f", SM {k['sm_mhz']}/{k['sm_max_mhz']} MHz, memory {k['mem_mhz']}/{k['mem_max_mhz']} MHz, "
                  f"power limit {k['power_limit_w']:.0f} W after the run")
    held = c.get("sustained_matmul_flops_per_s")
    con.print(f"{r['device']}{where}, torch {r['torch']}: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
              f"matmul {c['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s"
              + (f" ({held / 1e12:.0f} sustained over seconds)" if held else "") + " (measured in this run)")
    tp = o.get("tensor_parallel_size", 1)
    table = Table(title=f"{o['preset']} {o['dtype']}, {o['rows']} rows, prompts {o['prompt_min']}-{o['prompt_max']}, "
                  f"{o['max_new_tokens']} new tokens, rank {o['rank']} on all modules"
                  + (f", tensor-parallel size {tp} (floors per rank, all-reduces included)" if tp > 1 else ""),
                  title_justify="left")
    for col in ("adapters", "tok/s", "vs base", "decode iters", "rows (median)", "decode ms", "floor ms", "x floor",
                "full-batch ms", "full floor ms", "full x floor", "full x staged floor", "prefill s", "prefill floor s",
                "prefill x floor"):
        table.add_column(col, justify="right")
    for s in r["scenarios"]:
        d, f = s["decode"] or {}, s["decode_full_batch"] or {}

        def ms(v):
            return "-" if v is None else f"{v * 1e3:.2f}"

        table.add_row(f"{s['adapters']} (again)" if s.get("repeat") else str(s["adapters"]), f"{s['tokens_per_s']:.0f}",
                      "-" if s["tokens_per_s_vs_base"] is None else f"{s['tokens_per_s_vs_base']:.2f}",
                      str(d.get("iterations", 0)), str(d.get("median_rows", "-")), ms(d.get("median_s")),
                      ms(d.get("median_floor_s")), f"{d['median_ratio']:.2f}" if d else "-", ms(f.get("median_s")),
                      ms(f.get("median_floor_s")), f"{f['median_ratio']:.2f}" if f else "-",
                      f"{f['median_staged_ratio']:.2f}" if f else "-",
                      f"{s['prefill']['seconds']:.2f}", f"{s['prefill']['floor_s']:.2f}",
                      "-" if s["prefill"]["ratio"] is None else f"{s['prefill']['ratio']:.2f}")
    con.print(table)


@bench_app.command("residency")
def bench_residency(
    workdir: Path = typer.Argument(..., help="Directory for the synthetic workspace (reused if complete) and outputs."),
    preset: str = typer.Option("llama-3-8b", "--preset", help="Model shape: llama-3-8b, or tiny (CPU smoke test)."),
    adapters: int = typer.Option(1000, "--adapters", min=1, help="Distinct adapters in the workspace."),
    rank: int = typer.Option(16, "--rank", min=1),
    targets: str = typer.Option("q_proj,v_proj", "--targets", help="Modules every adapter targets."),
    rows: int = typer.Option(8000, "--rows", min=1),
    zipf: float = typer.Option(1.0, "--zipf", help="Popularity exponent s: adapter k has weight 1/(k+1)^s."),
    prompt_min: int = typer.Option(128, "--prompt-min", min=1),
    prompt_max: int = typer.Option(1024, "--prompt-max", min=1),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1),
    slots: int = typer.Option(64, "--slots", min=1, help="GPU adapter slots of the limited run."),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs", min=1),
    max_batch_tokens: int = typer.Option(8192, "--max-batch-tokens", min=1),
    device: str = typer.Option("cuda", "--device"),
    dtype: str = typer.Option("bfloat16", "--dtype"),
    seed: int = typer.Option(0, "--seed"),
    runs: str = typer.Option("limited,all-resident", "--runs", help="Which runs: limited, all-resident or both."),
    prefetch_gpu_adapters: int = typer.Option(4, "--prefetch-gpu-adapters", min=0,
                                              help="batch-run's option of the same name (0: loads block)."),
    image_build_processes: int = typer.Option(0, "--image-build-processes", min=0,
                                              help="Build host images in this many worker processes instead of "
                                                   "the prefetch threads (GPU only; 0: the prefetch threads build them)."),
    warmup_rows: int = typer.Option(256, "--warmup-rows", min=0,
                                    help="Rows of an untimed warm-up job before each run (compiles its kernels; 0: none)."),
    memory_ledger: str = typer.Option("split", "--memory-ledger",
                                      help="batch-run's option of the same name (joint: KV and slots from one arena)."),
    compare: Optional[Path] = typer.Option(None, "--compare", help="The JSON (--out) of an earlier call of the same job "
                                           "with the other run: its run joins these results and the ratio."),
    json_out: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON results to this file."),
) -> None:
    """Run a many-adapter batch-run job with limited GPU slots against the same job with every adapter resident.

    \f
    Most of its lines are the Typer option declarations and the table. (Text after the form feed is not shown in --help.)"""
    from mlora.bench.residency import ResidencyBenchOptions, run_residency_bench

    err = Console(stderr=True)
    _check_options(err, device, preset, dtype)
    opts = ResidencyBenchOptions(preset=preset, adapters=adapters, rank=rank,
                                 targets=tuple(t.strip() for t in targets.split(",") if t.strip()), rows=rows, zipf=zipf,
                                 prompt_min=prompt_min, prompt_max=prompt_max, max_new_tokens=max_new_tokens, slots=slots,
                                 max_num_seqs=max_num_seqs, max_batch_tokens=max_batch_tokens, device=device, dtype=dtype,
                                 seed=seed, runs=tuple(r.strip() for r in runs.split(",") if r.strip()),
                                 prefetch_gpu_adapters=prefetch_gpu_adapters,
                                 image_build_processes=image_build_processes, warmup_rows=warmup_rows,
                                 memory_ledger=memory_ledger)
    earlier = None
    if compare is not None:  # read and check before the long run, not after it
        from mlora.bench.residency import check_comparable, options_record

        try:
            earlier = json.loads(Path(compare).read_text())
            check_comparable(options_record(opts), earlier)
        except (OSError, ValueError) as exc:
            err.print(f"[red]error[/red] E_BENCH_COMPARE: {compare}: {exc}; compare with the --out of a call "
                      "of the same job")
            raise typer.Exit(2) from None
    results = run_residency_bench(str(workdir), opts, progress=None if json_out else _progress_line(err))
    if earlier is not None:
        from mlora.bench.residency import combine

        results = combine(results, earlier)
    if _save(results, out, json_out):
        return
    con = Console()
    table = Table(title=f"{preset}: {adapters} adapters (rank {rank}, {targets}), Zipf({zipf}), {rows} rows",
                  title_justify="left")
    for col in ("run", "slots", "tok/s (generation)", "load amplification", "loads", "evictions", "prefetch precision",
                "mean load ms", "copy ms", "error rows"):
        table.add_column(col, justify="right")
    for r in results["runs"]:
        m, lat, pp, amp = r["metrics"], r["mean_load_s"], r["metrics"]["prefetch_precision"], r["metrics"]["load_amplification"]
        table.add_row(r["name"], str(r["slots"]), f"{r['tokens_per_s']:.0f}", "-" if amp is None else f"{amp:.3f}",
                      str(r["loads"]), str(sum(m["evictions"].values())), "-" if pp is None else f"{pp:.2f}",
                      "-" if lat is None else f"{lat * 1e3:.1f}",
                      "-" if r.get("load_device_ms_mean") is None else f"{r['load_device_ms_mean']:.2f}",
                      str(r["error_rows"]))
    con.print(table)
    floor, ratio = results["cold_load_floor_s"], results["throughput_ratio"]
    con.print(f"throughput ratio (limited / all resident): {'-' if ratio is None else f'{ratio:.3f}'}; one adapter "
              f"{results['adapter_bytes'] / 1e6:.1f} MB, cold-load floor "
              + ("-" if floor is None else f"{floor * 1e3:.2f} ms at {results['h2d_bytes_per_s'] / 1e9:.1f} GB/s H2D"))
    from mlora.bench.residency import COLD_LOAD_TARGET, cold_load_vs_floor

    for r in results["runs"]:
        x = cold_load_vs_floor(r, floor)
        if x:  # the copy stream's time per job load against the floor (the cold-load target, COLD_LOAD_TARGET)
            con.print(f"{r['name']}: cold load (copy stream per load) "
                      + ", ".join(f"{k} {v:.2f}x" for k, v in x.items())
                      + f" the floor (target <= {COLD_LOAD_TARGET:g}x)")
    for r in results["runs"]:
        b = r.get("image_builds") or {}
        if b:
            con.print(f"{r['name']}: {b.get('images_built_in_workers', 0)} host images built in worker processes, "
                      f"{b.get('image_worker_failures', 0)} handed back and built on a prefetch thread")


@bench_app.command("bundle")
def bench_bundle(
    workdir: Path = typer.Argument(..., help="Directory for the synthetic workspace and bundle (reused if complete)."),
    preset: str = typer.Option("mistral-7b", "--preset", help="Model shape: mistral-7b, llama-3-8b, or tiny (CPU smoke test)."),
    adapters: int = typer.Option(1024, "--adapters", min=1, help="Adapters in the collection (all bundle members)."),
    rank: int = typer.Option(16, "--rank", min=1, help="The adapters' rank."),
    targets: str = typer.Option("q_proj,k_proj,v_proj", "--targets", help="Modules every adapter targets."),
    shared_rank: int = typer.Option(48, "--shared-rank", min=1, help="Rank of the subspace the collection shares."),
    noise: float = typer.Option(0.05, "--noise", min=0.0, help="Independent noise, relative to the shared part."),
    method: str = typer.Option("jd-full", "--method"),
    bundle_rank: int = typer.Option(64, "--bundle-rank", min=1, help="The bundle's shared rank R."),
    clusters: int = typer.Option(8, "--clusters", min=1),
    compress_device: str = typer.Option("auto", "--compress-device", help="auto, cpu or cuda."),
    rows: int = typer.Option(2048, "--rows", min=1),
    zipf: float = typer.Option(0.0, "--zipf", help="Popularity exponent s (0 = adapters uniform over rows)."),
    prompt_min: int = typer.Option(128, "--prompt-min", min=1),
    prompt_max: int = typer.Option(1024, "--prompt-max", min=1),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1),
    slots: Optional[int] = typer.Option(None, "--slots", min=1,
                                        help="GPU slots of the uncompressed run (default: what the bundle's bytes hold)."),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs", min=1),
    max_batch_tokens: int = typer.Option(8192, "--max-batch-tokens", min=1),
    device: str = typer.Option("cuda", "--device"),
    dtype: str = typer.Option("bfloat16", "--dtype"),
    seed: int = typer.Option(0, "--seed"),
    runs: str = typer.Option("bundle,adapters,base", "--runs",
                             help="Which runs (they run in the order bundle, base, bundle-triton, adapters): bundle, adapters, base, bundle-triton (the bundle through --bundle-operator three-stage-triton, experimental); none = only write the workspace and bundle."),
    warmup_rows: int = typer.Option(256, "--warmup-rows", min=0,
                                    help="Rows of an untimed warm-up job before each run (compiles its kernels; 0: none)."),
    json_out: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON results to this file."),
) -> None:
    """Serve bundle members (three-stage operator) against the uncompressed adapters under the same
    GPU memory, and against the base model alone."""
    from mlora.bench.bundle import BUNDLE_RUNS, BundleBenchOptions, run_bundle_bench

    err = Console(stderr=True)
    names = tuple(r.strip() for r in runs.split(",") if r.strip() not in ("", "none"))
    unknown = sorted(set(names) - set(BUNDLE_RUNS))
    if unknown:
        err.print(f"[red]error:[/red] --runs: unknown run(s) {', '.join(unknown)}; choose from "
                  f"{', '.join(BUNDLE_RUNS)} or none")
        raise typer.Exit(2)
    _check_options(err, device, preset, dtype)
    opts = BundleBenchOptions(preset=preset, adapters=adapters, rank=rank,
                              targets=tuple(t.strip() for t in targets.split(",") if t.strip()), shared_rank=shared_rank,
                              noise=noise, method=method, bundle_rank=bundle_rank, clusters=clusters,
                              compress_device=compress_device, rows=rows, zipf=zipf, prompt_min=prompt_min,
                              prompt_max=prompt_max, max_new_tokens=max_new_tokens, slots=slots,
                              max_num_seqs=max_num_seqs, max_batch_tokens=max_batch_tokens, device=device, dtype=dtype,
                              seed=seed, runs=names, warmup_rows=warmup_rows)
    results = run_bundle_bench(str(workdir), opts, progress=None if json_out else _progress_line(err))
    if _save(results, out, json_out):
        return
    con = Console()
    c = results["workspace"]["compress"]
    con.print(f"{preset}: {adapters} adapters (rank {rank}, {targets}), {rows} rows; bundle {method} "
              f"R={bundle_rank}, {clusters} clusters: compressed in {c['seconds']:.1f} s on {c['device']}, worst "
              f"error {c['worst_error']:.3f}, {results['bundle_device_bytes'] / 2**30:.2f} GiB on the device = "
              f"{results['slots']} uncompressed slots")
    if not results["runs"]:
        return
    table = Table(title_justify="left")
    for col in ("run", "tok/s (generation)", "wall s", "iterations", "loads", "load amplification", "error rows"):
        table.add_column(col, justify="right")
    for r in results["runs"]:
        amp = r["load_amplification"]
        table.add_row(r["name"], f"{r['tokens_per_s']:.0f}", f"{r['wall_s']:.1f}", str(r["iterations"]),
                      str(r["loads"]), "-" if amp is None else f"{amp:.3f}", str(r["error_rows"]))
    con.print(table)
    fmt = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    con.print(f"bundle / uncompressed: {fmt(results['bundle_vs_adapters'])} (target >= 1.5x); "
              f"bundle / base: {fmt(results['bundle_vs_base'])} (target >= 0.8x); "
              f"bundle through Triton / bundle: {fmt(results['bundle_triton_vs_bundle'])}")


@bench_app.command("peft")
def bench_peft(
    preset: str = typer.Option("llama-3-8b", "--preset", help="Model shape: llama-3-8b, or tiny (CPU smoke test)."),
    rows: int = typer.Option(512, "--rows", min=1),
    adapters: int = typer.Option(8, "--adapters", min=0, help="Distinct adapters (0 = base only)."),
    rank: int = typer.Option(16, "--rank", min=1),
    batch_size: int = typer.Option(0, "--batch-size", min=0,
                                   help="Rows per generate() call; 0: the largest that fits (256, halved on out-of-memory)."),
    prompt_min: int = typer.Option(128, "--prompt-min", min=1),
    prompt_max: int = typer.Option(1024, "--prompt-max", min=1),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1),
    device: str = typer.Option("cuda", "--device"),
    dtype: str = typer.Option("bfloat16", "--dtype"),
    seed: int = typer.Option(0, "--seed"),
    json_out: bool = typer.Option(False, "--json"),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON result to this file."),
) -> None:
    """The same synthetic job as `bench batch` through transformers + PEFT (generate with adapter_names)."""
    from mlora.bench.batch import BatchBenchOptions
    from mlora.bench.peft import run_peft_baseline

    err = Console(stderr=True)
    _check_options(err, device, preset, dtype)
    opts = BatchBenchOptions(preset=preset, rows=rows, rank=rank, prompt_min=prompt_min, prompt_max=prompt_max,
                             max_new_tokens=max_new_tokens, device=device, dtype=dtype, seed=seed)
    def progress(done, total, tokens, seconds, setup, running):  # stderr, also with --json: a stopped run keeps its rate
        inside = f" (+{running} rows generating)" if running else ""
        err.print(f"[dim]{done}/{total} rows done{inside}, {tokens} tokens in {seconds:.1f} s "
                  f"({tokens / max(seconds, 1e-9):.1f} tok/s; model and adapters built in {setup:.1f} s)[/dim]")

    r = run_peft_baseline(opts, adapters, batch_size, progress=progress)
    if not _save(r, out, json_out, indent=None):
        Console().print(f"transformers + PEFT, {adapters} adapters, batch {r['batch_size']}: {r['tokens_per_s']:.1f} "
                        f"generated tokens/s ({r['generated_tokens']} tokens in {r['wall_s']:.1f} s)")


@bench_app.command("startup")
def bench_startup(
    workdir: Path = typer.Argument(..., help="Directory for a random checkpoint of --preset (reused if present); "
                                   "ignored with --base."),
    base: Optional[Path] = typer.Option(None, "--base", help="Measure this checkpoint instead of a random one."),
    preset: str = typer.Option("llama-3-8b", "--preset", help="Shape of the random checkpoint (tiny: CPU smoke test)."),
    device: str = typer.Option("cuda", "--device"),
    dtype: str = typer.Option("bfloat16", "--dtype"),
    json_out: bool = typer.Option(False, "--json"),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON result to this file."),
) -> None:
    """Checkpoint to device and first token, against the checkpoint's bytes over the disk's cold read
    bandwidth, read in the same run (target: 1.5 x that + 10 s)."""
    import torch

    from mlora.bench.residency import write_base
    from mlora.bench.startup import run_startup_bench

    err = Console(stderr=True)
    _check_options(err, device, preset, dtype)
    if base is None:
        base = workdir / "base"
        if not (base / "config.json").exists():
            err.print(f"[dim]writing a random {preset} checkpoint to {base}[/dim]")
            write_base(str(base), preset, torch.bfloat16, 0, device="cuda" if device == "cuda" else "cpu")
    r = run_startup_bench(str(base), device, dtype)
    if _save(r, out, json_out):
        return
    Console().print(f"{r['checkpoint_bytes'] / 1e9:.2f} GB checkpoint, cold read {r['read_bytes_per_s'] / 1e9:.2f} GB/s "
                    f"(page cache dropped: {'yes' if r['cache_dropped'] else 'NO, figures are warm'}): load to "
                    f"{r['device']} {r['load_s']:.1f} s, first token {r['first_token_s']:.1f} s; floor {r['floor_s']:.1f} s, "
                    f"target {r['target_s']:.1f} s: {'met' if r['met'] else 'not met'}")


@bench_app.command("gpus")
def bench_gpus(
    workdir: Path = typer.Argument(..., help="Directory for the synthetic workspace (reused if complete) and outputs."),
    gpus: str = typer.Option("0,1", "--gpus", help="GPUs of the replicas and tp runs (the one-GPU run uses the first)."),
    num_workers: int = typer.Option(2, "--num-workers", min=1,
                                    help="--device cpu: CPU processes of the replicas and tp runs (as --gpus counts GPUs)."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", min=1,
                                             help="Adds the tp run: --gpus with --tensor-parallel-size N (N divides the GPUs)."),
    runs: Optional[str] = typer.Option(None, "--runs", help="Runs to make, a subset of one,replicas,tp "
                                       "(default: one,replicas, and tp with --tensor-parallel-size N)."),
    preset: str = typer.Option("llama-3-8b", "--preset", help="Model shape: llama-3-8b, or tiny (CPU smoke test)."),
    adapters: int = typer.Option(64, "--adapters", min=1, help="Distinct adapters (rows pick one uniformly)."),
    rows: int = typer.Option(2048, "--rows", min=1),
    rank: int = typer.Option(16, "--rank", min=1),
    prompt_min: int = typer.Option(128, "--prompt-min", min=1),
    prompt_max: int = typer.Option(1024, "--prompt-max", min=1),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs", min=1),
    max_batch_tokens: int = typer.Option(8192, "--max-batch-tokens", min=1),
    device: str = typer.Option("cuda", "--device", help="cuda, or cpu (a smoke run with CPU worker processes)."),
    dtype: str = typer.Option("bfloat16", "--dtype"),
    seed: int = typer.Option(0, "--seed"),
    json_out: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON results to this file."),
) -> None:
    """A synthetic many-adapter job through `mlora batch-run` on one GPU, with --gpus, and with --gpus at
    --tensor-parallel-size N; prints each run's tokens/s, the speed-ups and whether the outputs agree."""
    from mlora.bench.gpus import GpusBenchOptions, check_options, run_gpus_bench

    err = Console(stderr=True)
    _check_options(err, device, preset, dtype)
    opts = GpusBenchOptions(preset=preset, gpus=gpus, num_workers=num_workers, tensor_parallel_size=tensor_parallel_size,
                            runs=tuple(r.strip() for r in runs.split(",")) if runs else (), adapters=adapters,
                            rows=rows, rank=rank, prompt_min=prompt_min, prompt_max=prompt_max,
                            max_new_tokens=max_new_tokens, max_num_seqs=max_num_seqs, max_batch_tokens=max_batch_tokens,
                            device=device, dtype=dtype, seed=seed)
    try:
        check_options(opts)
    except ValueError as exc:
        _usage(err, str(exc))
    try:
        results = run_gpus_bench(str(workdir), opts, progress=None if json_out else _progress_line(err))
    except RuntimeError as exc:
        err.print(f"Error: {exc}", markup=False, highlight=False)
        raise typer.Exit(1)
    if _save(results, out, json_out):
        return
    con = Console()
    table = Table(title=f"{preset}: {adapters} adapters (rank {rank}, every projection), {rows} rows, "
                        f"{max_new_tokens} new tokens, {dtype}", title_justify="left")
    # rows differing: from the first run's (tokens, finish reason, error code)
    for col in ("run", "device", "gen. tok/s", "wall", "load ampl.", "error rows", "rows differing"):
        table.add_column(col, justify="right")
    for r in results["runs"]:
        amp = r["load_amplification"]
        differ = "-" if r["compared_with"] == r["name"] else str(r["rows_differing"])
        table.add_row(r["name"], r["device"], f"{r['tokens_per_s']:.0f}", f"{r['wall_s']:.1f} s",
                      "-" if amp is None else f"{amp:.3f}", str(r["error_rows"]), differ)
    con.print(table)
    for sp in results["speedups"]:
        tps, wall = sp["tokens_per_s"], sp["wall"]
        con.print(f"speed-up {sp['run']} / {sp['against']}: {'-' if tps is None else f'{tps:.2f}x'} generation "
                  f"tokens/s, {'-' if wall is None else f'{wall:.2f}x'} wall time")
    if results["outputs_equal"] is not None:
        con.print(f"outputs equal to the {results['runs'][0]['name']} run's (tokens, finish reasons, errors): "
                  f"{'yes' if results['outputs_equal'] else 'NO'}")


@bench_app.command("prefix")
def bench_prefix(
    preset: str = typer.Option("llama-3-8b", "--preset", help="Model shape: llama-3-8b, or tiny (CPU smoke test)."),
    rows: int = typer.Option(2048, "--rows", min=1, help="Rows per job (the issue's figure: 4096, one job per call)."),
    contexts: int = typer.Option(8, "--contexts", min=1, help="Shared contexts the rows start with."),
    context_tokens: int = typer.Option(1024, "--context-tokens", min=1, help="Tokens of each shared context."),
    question_tokens: int = typer.Option(128, "--question-tokens", min=1, help="Tokens of each row's own question."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1, help="Tokens generated per row (EOS ignored)."),
    adapters: int = typer.Option(16, "--adapters", min=1, help="Adapters the rows spread over, beside the base."),
    rank: int = typer.Option(16, "--rank", min=1, help="Rank of every random adapter (all linear modules)."),
    jobs: str = typer.Option("lora,alora,unshared", "--jobs", help="Jobs to run, each with the prefix cache on and off."),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs", min=1, help="Running rows per iteration."),
    max_batch_tokens: int = typer.Option(8192, "--max-batch-tokens", min=1, help="Rows per iteration (prefill chunks)."),
    device: str = typer.Option("cuda", "--device", help="cuda or cpu."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16, float16 or float32."),
    seed: int = typer.Option(0, "--seed"),
    json_out: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON results to this file."),
) -> None:
    """Rows sharing long contexts over many adapters (LoRA and aLoRA) with the prefix cache on and off:
    prompt tokens computed against the ideal, tokens/s on / off."""
    from mlora.bench.prefix import PrefixBenchOptions, check_options, run_prefix_bench

    err = Console(stderr=True)
    _check_options(err, device, preset, dtype)
    opts = PrefixBenchOptions(preset=preset, rows=rows, contexts=contexts, context_tokens=context_tokens,
                              question_tokens=question_tokens, max_new_tokens=max_new_tokens, adapters=adapters,
                              rank=rank, jobs=tuple(j.strip() for j in jobs.split(",")), max_num_seqs=max_num_seqs,
                              max_batch_tokens=max_batch_tokens, device=device, dtype=dtype, seed=seed)
    try:
        check_options(opts)
    except ValueError as exc:
        _usage(err, str(exc))

    def progress(s):
        p = s["prefix"]
        err.print(f"[dim]{s['job']}, cache {'on' if s['prefix_cache'] else 'off'}: {s['tokens_per_s']:.1f} tok/s, "
                  f"wall {s['wall_s']:.1f} s; computed {s['prefill_tokens_computed']} of {s['prompt_tokens']} prompt "
                  f"tokens ({s['computed_vs_ideal']:.3f}x ideal), {s['preemptions']} preemptions; cache hit "
                  + ("-" if p["hit_rate"] is None else f"{p['hit_rate']:.3f}")
                  + f", {p['evictions']} evictions, {p['shared_blocks_peak']} shared blocks at most[/dim]",
                  soft_wrap=True)

    try:
        results = run_prefix_bench(opts, progress=None if json_out else progress)
    except ValueError as exc:  # the KV cache the job needs does not fit the GPU
        _usage(err, str(exc))
    except RuntimeError as exc:  # rows that failed: no figure stands
        fail(err, "E_BENCH_ROWS_FAILED", str(exc), 1)
    if not _save(results, out, json_out):
        _print_prefix_table(results)


def _print_prefix_table(r: dict) -> None:
    con = Console()
    o, kv = r["options"], r["kv_cache"]
    con.print(f"{r['device']}, torch {r['torch']}; KV cache {kv['num_blocks']} blocks of {o['block_size']} tokens "
              f"({kv['kv_bytes'] / 2**30:.2f} GiB: {kv['context_blocks']} for the shared contexts, "
              f"{kv['running_blocks']} for {o['max_num_seqs']} running rows"
              + (f"; {kv['available_blocks']} fit the GPU" if kv["available_blocks"] is not None else "") + ")",
              soft_wrap=True)
    table = Table(title=f"{o['preset']} {o['dtype']}, {o['rows']} rows: {o['contexts']} contexts of "
                  f"{o['context_tokens']} tokens + {o['question_tokens']}-token questions, {o['max_new_tokens']} new "
                  f"tokens, {o['adapters']} rank-{o['rank']} adapters and the base", title_justify="left")
    for col in ("job", "cache", "prompt tokens", "computed", "reused", "computed / ideal", "tok/s", "wall s",
                "preemptions", "hit rate", "evictions", "shared peak"):
        table.add_column(col, justify="right")
    for job in r["jobs"]:
        for s in job["runs"]:
            p = s["prefix"]
            table.add_row(job["job"], "on" if s["prefix_cache"] else "off", str(s["prompt_tokens"]),
                          str(s["prefill_tokens_computed"]), str(s["prefill_tokens_reused"]),
                          f"{s['computed_vs_ideal']:.3f}", f"{s['tokens_per_s']:.0f}", f"{s['wall_s']:.1f}",
                          str(s["preemptions"]), "-" if p["hit_rate"] is None else f"{p['hit_rate']:.3f}",
                          str(p["evictions"]), str(p["shared_blocks_peak"]))
    con.print(table)
    for job in r["jobs"]:
        said = "; ".join(f"{t['name']} {t['value']:.3f} ({'<=' if t['at_most'] else '>='} {t['limit']}: "
                         f"{'met' if t['met'] else 'NOT met'})" for t in job["targets"])
        ratio = "" if any(t["name"] == "tokens/s on / off" for t in job["targets"]) else \
            f"tokens/s on / off {job['tokens_per_s_ratio']:.3f}; "
        con.print(f"{job['job']}: ideal {job['ideal_computed']} of {job['prompt_tokens']} prompt tokens computed, "
                  f"{job['rows_with_other_tokens']} rows with other tokens on than off; {ratio}{said}", soft_wrap=True)
