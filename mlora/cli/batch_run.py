"""``mlora batch-run``: thin CLI over :func:`mlora.batch.runner.run_job`.

Parses options, shows progress on stderr (rich, only on a terminal and without
``--quiet``), prints the end-of-run summary (a table, or JSON with ``--json``)
and maps errors to exit codes: 1 for invalid input / adapters / resume
mismatch, 2 for usage errors, 3 for runtime failures (rerun with ``--resume``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from mlora.cli.render import fail as _fail

EXIT_INVALID, EXIT_USAGE, EXIT_RUNTIME = 1, 2, 3


def batch_run(
    input: str = typer.Argument(..., metavar="INPUT", help="Parquet file, directory of Parquet files, or glob."),
    output: Path = typer.Argument(..., metavar="OUTPUT", help="Output directory (Parquet shards, _manifest.json, _SUCCESS)."),
    base: Path = typer.Option(..., "--base", exists=True, file_okay=False, help="Base checkpoint directory."),
    adapters: Optional[Path] = typer.Option(None, "--adapters", exists=True, file_okay=False,
                                            help="Directory whose sub-directories are adapters (id = name)."),
    catalog: Optional[Path] = typer.Option(None, "--catalog", exists=True, dir_okay=False,
                                           help="JSON catalog: id -> path or {path, artifact_sha256}."),
    allow_pickle: bool = typer.Option(False, "--allow-pickle",
                                      help="Serve adapter_model.bin adapters, read with torch.load(weights_only=True) (trusted files only)."),
    id_column: str = typer.Option("id", "--id-column", help="Row id column (generated from the row position if absent)."),
    prompt_column: Optional[str] = typer.Option(None, "--prompt-column", help="Text prompt column (default: prompt)."),
    prompt_ids_column: Optional[str] = typer.Option(None, "--prompt-ids-column", help="Token-id prompt column instead of text."),
    messages_column: Optional[str] = typer.Option(None, "--messages-column", help="Chat messages column (list of {role, content}) instead of a prompt, rendered with the base's chat template."),
    adapter_column: str = typer.Option("adapter", "--adapter-column", help="Adapter id column (null, empty or __base__ = base model)."),
    max_new_tokens_column: Optional[str] = typer.Option(None, "--max-new-tokens-column", help="Per-row max_new_tokens column."),
    keep_columns: Optional[List[str]] = typer.Option(None, "--keep-columns", help="Input columns to copy to the output (repeat or comma-separate)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Default new-token limit per row (>= 1)."),
    temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature, >= 0 (0 = greedy, the default)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass, in (0, 1]."),
    top_k: int = typer.Option(0, "--top-k", help="Top-k sampling, >= 0 (0 = off)."),
    seed: int = typer.Option(0, "--seed", help="Job seed; a row's random stream depends only on it and the row id."),
    stop: Optional[List[str]] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    strict: bool = typer.Option(False, "--strict", help="Fail the job (exit 1) if any referenced adapter is unknown or unservable."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted job in OUTPUT."),
    device: str = typer.Option("auto", "--device", help="auto | cuda | cpu."),
    dtype: str = typer.Option("auto", "--dtype", help="auto | bfloat16 | float16 | float32 (auto: float32 on CPU, the checkpoint's on GPU)."),
    max_num_seqs: int = typer.Option(64, "--max-num-seqs", help="Sequences decoded together (>= 1)."),
    max_batch_tokens: int = typer.Option(2048, "--max-batch-tokens", help="Token budget of one iteration (chunked prefill; >= 1)."),
    gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization", help="Fraction of GPU memory mlora may use, in (0, 1]."),
    max_gpu_adapters: Optional[int] = typer.Option(None, "--max-gpu-adapters", help="GPU adapter slots, >= 1 (default: every adapter the job names, at most what fits in a quarter of the free GPU memory; one per adapter on the CPU). For a bundle served three-stage: the members' core slots."),
    host_cache_gb: Optional[float] = typer.Option(None, "--host-cache-gb",
                                                  help="Host cache of adapter images in GiB, pinned at start on a GPU (default: 128 images on a "
                                                       "GPU, unbounded on the CPU; 0: no cache, every load reads its adapter again)."),
    kv_cache_gb: Optional[float] = typer.Option(None, "--kv-cache-gb", help="KV cache size in GiB, > 0 (default: from free memory on GPU, max-num-seqs full contexts on CPU). On a GPU the adapter slots then get the rest of the usable memory instead of a quarter."),
    shard_rows: int = typer.Option(10000, "--shard-rows", help="Rows per output shard (>= 1)."),
    commit_interval: float = typer.Option(60.0, "--commit-interval",
                                          help="Seconds (> 0): a shard is also committed when this long has passed since the last commit, so an interrupted job loses at most about this much finished work."),
    allow_duplicate_ids: bool = typer.Option(False, "--allow-duplicate-ids",
                                             help="Run rows whose ids repeat (default: refused, E_INPUT_DUPLICATE_ID); each row is written once, resume goes by row position."),
    schedule_window: int = typer.Option(8192, "--schedule-window",
                                        help="Input rows (>= 1) the scheduler may reorder to group rows by adapter: an adapter is loaded about once per window; up to a window of finished rows waits in memory for the output order."),
    prefetch_adapters: int = typer.Option(16, "--prefetch-adapters",
                                          help="Cold adapters of waiting rows read and verified ahead, in the background (>= 0; 0: off)."),
    prefetch_gpu_adapters: int = typer.Option(4, "--prefetch-gpu-adapters",
                                              help="Of the prefetched adapters, how many (>= 0) may start loading into free or unneeded GPU slots per iteration, while the current rows run; on a GPU admission also starts loads without waiting for them (0: both off, loads block)."),
    preload_adapters: bool = typer.Option(False, "--preload-adapters",
                                          help="Load adapters into their GPU slots (as many as there are slots) before the first row."),
    bundle_operator: str = typer.Option("auto", "--bundle-operator",
                                        help="How bundle members are served: auto (three-stage when every adapter of the job is a member of one bundle), three-stage, materialized (each member's factors in a slot), or three-stage-triton (three-stage through the segmented Triton kernels; CUDA only, experimental)."),
    memory_ledger: str = typer.Option("split", "--memory-ledger",
                                      help="split: the KV cache and the adapter slots get fixed shares of the memory budget; joint: both are carved from one arena of pages (KV growth may evict idle adapters, an idle slot's pages serve as KV; slot banks only, a bundle served three-stage is refused). docs/sizing.md"),
    cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--no-cuda-graphs",
                                     help="Replay decode steps from CUDA graphs on a GPU (--no-cuda-graphs: eager, for debugging)."),
    lookahead: bool = typer.Option(True, "--lookahead/--no-lookahead",
                                   help="Build the next decode iteration's inputs while the device runs the current one (same outputs; --no-lookahead: strictly serial, for debugging)."),
    prefix_cache: bool = typer.Option(True, "--prefix-cache/--no-prefix-cache",
                                      help="Rows share the KV of identical prompt prefixes, computed once. Same outputs either way: --no-prefix-cache to compare."),
    alora_without_invocation: str = typer.Option("error", "--alora-without-invocation",
                                                  help="error | base: an aLoRA row whose prompt lacks the adapter's invocation tokens is an error row (E_ALORA_NO_INVOCATION) or, with base, runs on the base model as PEFT does (counted in _metrics.json)."),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="One worker process per GPU (per N GPUs with --tensor-parallel-size N): 0,1,... or all (docs/scaleout.md)."),
    num_workers: Optional[int] = typer.Option(None, "--num-workers",
                                              help="--engine local: N >= 1 worker processes on the CPU (--device cpu); --engine ray: N actors."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size",
                                             help="One model sharded over N rank processes started by mlora (one GPU each; gloo on the CPU): for bases larger than one GPU (docs/scaleout.md)."),
    engine: str = typer.Option("local", "--engine", help="local (this host) | ray (Ray Data; pip install 'mlora[ray]')."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="--engine ray: address of a running Ray cluster (default: start a local one)."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr."),
) -> None:
    """Generate a completion for every input row with the adapter it names (Parquet in, Parquet out).

    \f
    Most of its lines are the Typer option declarations. (Text after the form feed is not shown in --help.)"""
    from mlora.batch.config import JobConfig
    from mlora.batch.errors import JobError
    from mlora.batch.runner import run_job

    err = Console(stderr=True)
    if adapters is not None and catalog is not None:
        _fail(err, "E_USAGE", "give either --adapters DIR or --catalog FILE, not both", EXIT_USAGE)
    if prompt_column and prompt_ids_column:
        _fail(err, "E_USAGE", "give either --prompt-column or --prompt-ids-column, not both", EXIT_USAGE)
    if messages_column and (prompt_column or prompt_ids_column):
        _fail(err, "E_USAGE", "--messages-column replaces the prompt: give it without --prompt-column and "
              "--prompt-ids-column", EXIT_USAGE)
    keep = tuple(c.strip() for item in (keep_columns or []) for c in item.split(",") if c.strip())
    opts = JobConfig(
        input=input, output=str(output), base=str(base),
        adapters_dir=str(adapters) if adapters else None, catalog_file=str(catalog) if catalog else None,
        allow_pickle=allow_pickle,
        id_column=id_column, prompt_column=None if (prompt_ids_column or messages_column) else (prompt_column or "prompt"),
        prompt_ids_column=prompt_ids_column, messages_column=messages_column, adapter_column=adapter_column,
        max_new_tokens_column=max_new_tokens_column, keep_columns=keep, max_new_tokens=max_new_tokens,
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=tuple(stop or ()), strict=strict,
        resume=resume, device=device, dtype=dtype, max_num_seqs=max_num_seqs, max_batch_tokens=max_batch_tokens,
        max_gpu_adapters=max_gpu_adapters, gpu_memory_utilization=gpu_memory_utilization, kv_cache_gb=kv_cache_gb, host_cache_gb=host_cache_gb,
        shard_rows=shard_rows, commit_interval=commit_interval, allow_duplicate_ids=allow_duplicate_ids,
        schedule_window=schedule_window, cuda_graphs=cuda_graphs, lookahead=lookahead,
        prefetch_adapters=prefetch_adapters, prefetch_gpu_adapters=prefetch_gpu_adapters,
        preload_adapters=preload_adapters, bundle_operator=bundle_operator, memory_ledger=memory_ledger,
        prefix_cache=prefix_cache, alora_without_invocation=alora_without_invocation,
        gpus=gpus, num_workers=num_workers, engine=engine, ray_address=ray_address,
        tensor_parallel_size=tensor_parallel_size,
    )
    show = not quiet and err.is_terminal
    bar = Progress(TextColumn("[bold]batch-run"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                   TimeRemainingColumn(), console=err, disable=not show)
    task = bar.add_task("rows", total=None, info="starting")

    def progress(summary, p):
        rate = p.generated_tokens / max(1e-9, time.perf_counter() - started)
        workers = f"  {p.workers} workers" if p.workers > 1 else ""
        bar.update(task, total=p.rows_total, completed=p.rows_done,
                   info=f"{rate:,.0f} tok/s  {p.running} running  {p.adapters} adapters{workers}")

    def note(text):
        if show:
            bar.console.print(f"note: {text}", markup=False, highlight=False)

    def phase(text, rows_total, rows_done):
        bar.update(task, total=rows_total, completed=rows_done, info=text)

    started = time.perf_counter()
    try:
        with bar:
            summary = run_job(opts, progress=progress, note=note, phase=phase)
    except JobError as exc:
        _fail(err, exc.code, str(exc).split(": ", 1)[-1], exc.exit_code)
    except ValueError as exc:  # the input, output, catalog and model errors carry a stable code
        code = getattr(exc, "code", None)
        if code is None:
            _runtime(err, exc)
        _fail(err, code, str(exc).split(": ", 1)[-1], EXIT_USAGE if _usage(code) else EXIT_INVALID)
    except KeyboardInterrupt:
        _fail(err, "E_INTERRUPTED", f"stopped; every committed shard in {output} is kept: rerun with --resume "
              "to finish the job", EXIT_RUNTIME)
    except Exception as exc:  # noqa: BLE001 - a runtime failure: say how to continue
        _runtime(err, exc)
    if json_out:
        sys.stdout.write(json.dumps(summary.to_json()) + "\n")
        return
    _print_summary(summary, output)


def _usage(code: str) -> bool:
    """Whether a coded input error is a usage error (exit 2): the ``*_USAGE`` codes, and an
    INPUT that names no file (a missing path, README "Exit codes")."""
    return code.endswith("_USAGE") or code == "E_INPUT_NOT_FOUND"


def _print_summary(summary, output: Path) -> None:
    con = Console()
    if summary.already_complete:
        con.print(f"{output} is already complete: all {summary.rows} rows were committed by an earlier run; "
                  "nothing to do.", markup=False, highlight=False)
        return
    # borderless columns: the summary, a scaled job's device included, fits 80 columns unwrapped
    table = Table(title=f"mlora batch-run -> {output}", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False, collapse_padding=True)
    for col in ("rows", "ok", "errors", "tokens", "tokens/s", "wall", "adapters", "device"):
        table.add_column(col, justify="right")
    table.add_row(str(summary.rows), str(summary.ok_rows), str(summary.error_rows), str(summary.generated_tokens),
                  f"{summary.tokens_per_s:,.1f}", f"{summary.wall_s:.1f} s", str(summary.adapters), summary.device)
    con.print(table)
    if summary.unknown_adapters:
        con.print(f"unknown adapters ({len(summary.unknown_adapters)}, not served): "
                  + ", ".join(summary.unknown_adapters[:20]) + (" ..." if len(summary.unknown_adapters) > 20 else ""),
                  markup=False, highlight=False)
    if summary.unservable_adapters:
        con.print(f"unservable adapters ({len(summary.unservable_adapters)}, not served): "
                  + ", ".join(f"{a} {c}" for a, c in list(summary.unservable_adapters.items())[:20])
                  + (" ..." if len(summary.unservable_adapters) > 20 else ""), markup=False, highlight=False)
    if summary.prefill_tokens_reused or summary.prefix_cache_hit_rate is not None:
        rate = "-" if summary.prefix_cache_hit_rate is None else f"{summary.prefix_cache_hit_rate:.1%}"
        con.print(f"prompt tokens computed {summary.prefill_tokens_computed:,}, reused "
                  f"{summary.prefill_tokens_reused:,}; prefix cache hit rate {rate}", markup=False, highlight=False)
    if summary.errors_by_code:
        con.print("error rows by code: " + ", ".join(f"{k} {v}" for k, v in sorted(summary.errors_by_code.items())))


def _runtime(err: Console, exc: BaseException):
    if os.environ.get("MLORA_DEBUG") == "1":
        raise exc
    code = getattr(exc, "code", None) or "E_RUNTIME"
    _fail(err, code, f"{type(exc).__name__}: {exc}. Committed shards are kept: rerun with --resume "
          "(set MLORA_DEBUG=1 for a traceback)", EXIT_RUNTIME)
