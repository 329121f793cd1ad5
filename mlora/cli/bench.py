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

from ..lora_tools.hash_bench import run_hash_bench

bench_app = typer.Typer(help="Benchmarks (results belong in BENCHMARKS.md).", no_args_is_help=True)


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
