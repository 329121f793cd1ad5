"""``mlora merge``, ``mlora unmerge``, ``mlora release verify``: thin wrappers over ``mlora.lora_tools.release``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from mlora.cli.render import fail as _fail

EXIT_USAGE = 2

release_app = typer.Typer(help="Immutable merged releases.", no_args_is_help=True,
                          rich_markup_mode=None)  # plain help, as the app's (mlora.cli.app)


def merge(
    base: Path = typer.Option(..., "--base", exists=True, file_okay=False, help="The base checkpoint directory."),
    adapter: List[Path] = typer.Option(..., "--adapter", exists=True, file_okay=False, help="An adapter to merge (repeat; merged in order)."),
    weight: Optional[List[float]] = typer.Option(None, "--weight", help="Weight of each --adapter, in the same order (default 1)."),
    output: Path = typer.Option(..., "-o", "--output", help="The release directory to create (never overwritten)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (each tensor's own), bfloat16, float16 or float32."),
    compute_dtype: str = typer.Option("float32", "--compute-dtype", help="float32 or float64."),
    safe: bool = typer.Option(False, "--safe", help="Refuse (write nothing) if any merged value is not finite."),
    allow_base_mismatch: bool = typer.Option(False, "--allow-base-mismatch", help="Merge an adapter that declares "
                                             "another base (refused otherwise; recorded in release.json)."),
    json_out: bool = typer.Option(False, "--json", help="Print release.json's summary as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar on stderr."),
) -> None:
    """Merge adapters into a new, immutable base revision: W' = W + sum_k w_k s_k B_k A_k."""
    from mlora.lora_tools.release import MergeAdapter, ReleaseError
    from mlora.lora_tools.release import merge as do_merge

    err = Console(stderr=True)
    weights = list(weight or [])
    if weights and len(weights) != len(adapter):
        _fail(err, "E_USAGE", f"{len(weights)} --weight for {len(adapter)} --adapter: give one per adapter or none",
              EXIT_USAGE)
    pairs = [MergeAdapter(str(a), weights[i] if weights else 1.0) for i, a in enumerate(adapter)]
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    total = sum(f.stat().st_size for f in base.iterdir() if f.suffix == ".safetensors")
    bar = Progress(TextColumn("[bold]merge"), BarColumn(), DownloadColumn(), TimeRemainingColumn(), console=err,
                   disable=quiet or json_out or not err.is_terminal)
    task = bar.add_task("tensors", total=total)
    try:
        with bar:
            man = do_merge(str(base), pairs, str(output), dtype=dtype, compute_dtype=compute_dtype, safe=safe,
                           allow_base_mismatch=allow_base_mismatch,
                           progress=lambda name, nbytes: bar.advance(task, nbytes))
    except ReleaseError as exc:  # E_MERGE_USAGE: options that do not go together (exit 2)
        _fail(err, exc.code, exc.message, EXIT_USAGE if exc.code.endswith("_USAGE") else 1)
    _warn(err, man)
    _report(man, str(output), json_out)


def unmerge(
    release: Path = typer.Option(..., "--release", exists=True, file_okay=False, help="A merge release."),
    adapter: Optional[List[str]] = typer.Option(None, "--adapter", help="Adapter id to subtract (repeat; default all)."),
    output: Path = typer.Option(..., "-o", "--output", help="The new release directory (never overwritten)."),
    base: Optional[Path] = typer.Option(None, "--base", exists=True, file_okay=False, help="The clean base: report the drift against it."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Subtract merged adapters (reverse order) into a new release of kind arithmetic-unmerge. Not an exact rollback."""
    from mlora.lora_tools.release import ReleaseError
    from mlora.lora_tools.release import unmerge as do_unmerge

    err = Console(stderr=True)
    try:
        man, drift = do_unmerge(str(release), str(output), list(adapter or []), str(base) if base else None)
    except ReleaseError as exc:
        _fail(err, exc.code, exc.message)
    _warn(err, man)
    if json_out:
        sys.stdout.write(json.dumps({"release": str(output), "release_sha256": man["release_sha256"],
                                     "kind": man["kind"], "drift": drift}) + "\n")
        return
    con = Console()
    con.print(f"release {output} ({man['kind']}), sha256 {man['release_sha256']}")
    con.print("Arithmetic unmerge is not an exact rollback: the exact rollback is the clean base.")
    if drift is not None:
        con.print(f"Drift against {base}: {drift['tensors_differing']} tensors, {drift['elements_differing']} elements "
                  f"differ; max abs {drift['max_abs']:.3g}, max {drift['max_ulp']} ULP"
                  + (" (bit-identical)" if drift["exact"] else ""))


@release_app.command("verify")
def verify(
    release: Path = typer.Argument(..., exists=True, file_okay=False, help="The release directory."),
    base: Optional[Path] = typer.Option(None, "--base", exists=True, file_okay=False, help="Also check the parent base identity."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Re-hash every tensor of a release against release.json (exit 0 intact, 1 not)."""
    from mlora.lora_tools.release import ReleaseError
    from mlora.lora_tools.release import verify as do_verify

    err = Console(stderr=True)
    try:
        res = do_verify(str(release), str(base) if base else None)
    except ReleaseError as exc:
        if json_out:
            sys.stdout.write(json.dumps({"release": str(release), "ok": False, "code": exc.code,
                                         "message": exc.message}) + "\n")
        _fail(err, exc.code, exc.message)
    if json_out:
        sys.stdout.write(json.dumps(res) + "\n")
    else:
        Console().print(f"{release}: intact ({res['tensors']} tensors, {res['kind']}, sha256 {res['release_sha256']})"
                        + ("; parent base checked" if res.get("parent_checked") else ""))


def _warn(err: Console, man: dict) -> None:
    """The release's warnings (also in its release.json) on stderr, with or without --json or -q."""
    for w in man.get("warnings", []):
        err.print(f"Warning: {w['code']}: {w['message']}", markup=False, highlight=False)


def _report(man: dict, out: str, json_out: bool) -> None:
    if json_out:
        sys.stdout.write(json.dumps({"release": out, "release_sha256": man["release_sha256"], "kind": man["kind"],
                                     "adapters": man["adapters"], "changed": len(man["changed"])}) + "\n")
        return
    Console().print(f"release {out} ({man['kind']}): {len(man['adapters'])} adapter(s) merged into "
                    f"{len(man['changed'])} tensors; sha256 {man['release_sha256']}")
