"""``mlora compress fit|inspect|export``: fit a collection bundle, verify one, export a member.

Thin: parse options, call ``mlora.compress``, render. A Typer group: the first
word after ``compress`` is always a sub-command, so an adapter directory named
``inspect`` or ``export`` is an adapter path wherever the grammar places one
(``mlora compress fit inspect -o B``). ``mlora.compress`` and torch are imported
inside the commands, so that ``mlora --help`` and the other commands start without them.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import List, Optional

import click
import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

from mlora.cli.render import fail as _fail

EXIT_INVALID, EXIT_USAGE = 1, 2


class _CompressGroup(TyperGroup):
    """The sub-commands, and a usage error that names them when the first word is none of them."""

    def resolve_command(self, ctx: click.Context, args: list[str]):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            ctx.fail(f"no sub-command {args[0]!r}: use fit, inspect or export "
                     "(fit a bundle with `mlora compress fit ADAPTER... -o BUNDLE`)")
        return super().resolve_command(ctx, args)


compress_app = typer.Typer(cls=_CompressGroup, no_args_is_help=True,
                           help="Collection bundles: fit shared bases and per-adapter cores, inspect, export.")


@compress_app.command("fit")
def fit(
    adapters: List[str] = typer.Argument(..., help="Adapter directories, or directories of them."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="The bundle to write. Never overwritten."),
    method: str = typer.Option("jd-full", "--method", help="jd-full (orthonormal bases, R x R cores) or jd-diag."),
    rank: int = typer.Option(16, "--rank", help="Shared rank R."),
    clusters: str = typer.Option("1", "--clusters", help="Clusters per module: K, or 'auto' (smallest K meeting --max-error)."),
    normalize: bool = typer.Option(True, "--normalize/--no-normalize", help="Fit unit-norm updates (norms restored in the cores)."),
    iters: int = typer.Option(10, "--iters", min=1, help="Alternating sweeps per fit."),
    tol: float = typer.Option(1e-6, "--tol", help="Stop a fit when the objective's relative change is at most this."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    max_error: float = typer.Option(0.6, "--max-error", help="Largest squared relative error any member may have at any module."),
    seed: int = typer.Option(0, "--seed"),
    base: Optional[Path] = typer.Option(None, "--base", exists=True, file_okay=False, help="Bind members to this measured base."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr."),
) -> None:
    """Compress a collection of LoRA adapters into shared bases plus per-adapter cores (JD-Full / JD-Diag).

    \f
    Most of its lines are the Typer option declarations and the table. (Text after the form feed is not shown in --help.)"""
    err = Console(stderr=True)
    if output is None:
        _fail(err, "E_USAGE", "give the bundle to write with -o BUNDLE", EXIT_USAGE)
    import torch

    from mlora.compress import CompressError
    from mlora.compress.bundle import CompressOptions, write_bundle
    from mlora.compress.bundle import compress as fit_collection
    from mlora.compress.collection import load_collection

    k = "auto" if clusters == "auto" else _int(clusters, err)
    if device not in ("auto", "cpu", "cuda"):
        _fail(err, "E_USAGE", f"--device must be auto, cpu or cuda, got {device!r}", EXIT_USAGE)
    if device == "cuda" and not torch.cuda.is_available():
        _fail(err, "E_USAGE", "--device cuda: no CUDA device here; use --device cpu (or auto)", EXIT_USAGE)
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    opts = CompressOptions(method=method, rank=rank, clusters=k, normalize=normalize, iters=iters, tol=tol,
                           max_error=max_error, seed=seed, device=dev)
    try:  # option values out of range are usage errors, refused before any adapter is read
        opts.check()
    except CompressError as exc:
        _fail(err, exc.code, exc.message, EXIT_USAGE)
    show = not quiet  # progress goes to stderr, so --json (stdout) keeps it
    try:
        started = time.perf_counter()
        col = load_collection(list(adapters), str(base) if base else None)
        if show:
            err.print(f"[dim]{len(col.members)} members validated in {time.perf_counter() - started:.1f} s, "
                      f"{len(col.modules)} modules; fitting {method} R={rank} clusters={clusters} on {dev}[/dim]")
        done = [0]

        def progress(f):
            done[0] += 1
            if show:
                worst = max(f.result.errors)
                err.print(f"[dim]{done[0]:>4}/{len(col.modules)} {f.module}: K={f.result.K}, worst error {worst:.4f}, "
                          f"{f.seconds:.1f} s[/dim]")

        result = fit_collection(col, opts, progress)
        bad = result.offenders()
        if bad:
            if json_out:
                sys.stdout.write(json.dumps({"ok": False, "code": "E_COMPRESS_MAX_ERROR", "max_error": max_error,
                                             "offenders": [{"member": m, "module": mod, "error": _num(e)}
                                                           for m, mod, e in bad]}) + "\n")
            else:
                t = Table(title=f"members over --max-error {max_error} (no bundle written)", title_justify="left")
                for c in ("member", "module", "squared relative error"):
                    t.add_column(c)
                for m, mod, e in bad[:50]:
                    t.add_row(m, mod, f"{e:.4f}")
                if len(bad) > 50:
                    t.add_row("...", f"{len(bad) - 50} more", "")
                Console().print(t)
            _fail(err, "E_COMPRESS_MAX_ERROR", f"{len(bad)} member/module error(s) exceed --max-error {max_error}; "
                  "raise --rank or --clusters (or --clusters auto), or drop the outliers", EXIT_INVALID)
        man = write_bundle(result, str(output))
    except CompressError as exc:
        _fail(err, exc.code, exc.message, EXIT_INVALID)
    if json_out:
        sys.stdout.write(json.dumps({"ok": True, "bundle": str(output), "bundle_sha256": man["bundle_sha256"],
                                     "ledger": man["ledger"], "max_error_by_member": man["max_error_by_member"]}) + "\n")
    else:
        _print_summary(man, str(output))


def _int(text: str, err: Console) -> int:
    try:
        return int(text)
    except ValueError:
        _fail(err, "E_USAGE", f"--clusters takes an integer or 'auto', got {text!r}", EXIT_USAGE)


def _num(x: float):
    return x if math.isfinite(x) else str(x)


@compress_app.command("inspect")
def inspect_bundle(
    bundle: str = typer.Argument(..., help="The bundle directory."),
    json_out: bool = typer.Option(False, "--json", help="Print the bundle manifest as JSON on stdout."),
) -> None:
    """Verify a bundle (every file and tensor against its manifest) and print its ledger and errors."""
    from mlora.compress import CompressError
    from mlora.compress.bundle import read_bundle

    err = Console(stderr=True)
    try:
        b = read_bundle(bundle)
    except CompressError as exc:
        _fail(err, exc.code, exc.message, EXIT_INVALID)
    if json_out:
        sys.stdout.write(json.dumps(b.manifest) + "\n")
        return
    _print_summary(b.manifest, bundle)


def _print_summary(man: dict, path: str) -> None:
    con = Console()
    o, led = man["options"], man["ledger"]
    con.print(f"bundle {path}  sha256 {man['bundle_sha256']}")
    con.print(f"{len(man['members'])} members, {len(man['modules'])} modules, {o['method']} R={o['rank']} "
              f"clusters={o['clusters']} normalize={o['normalize']} seed={o['seed']}")
    if led["break_even_n"] is not None:
        even = f"break-even collection size {led['break_even_n']}"
    else:  # the ledger says why (members adapt different module sets), or no size saves parameters
        even = led.get("note") or "no collection size saves parameters under this count"
    con.print(f"parameters: LoRA {led['lora_params']:,} -> bundle {led['payload_params']:,} "
              f"(shared {led['shared_params']:,} + cores {led['core_params']:,}); {even}")
    t = Table(title="largest squared relative error per member (over its modules)", title_justify="left")
    t.add_column("member")
    t.add_column("error", justify="right")
    for m, e in sorted(man["max_error_by_member"].items()):
        t.add_row(m, e if isinstance(e, str) else f"{e:.4f}")
    con.print(t)


@compress_app.command("export")
def export_adapter(
    bundle: str = typer.Argument(..., help="The bundle directory."),
    adapter_id: str = typer.Argument(..., help="The member to export."),
    output: Path = typer.Option(..., "-o", "--output", help="The adapter directory to write. Never overwritten."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
) -> None:
    """Write one member of a bundle as a plain PEFT LoRA adapter (its compressed delta, rank R)."""
    from mlora.compress import CompressError
    from mlora.compress.bundle import export_member, read_bundle

    err, out = Console(stderr=True), str(output)
    try:
        info = export_member(read_bundle(bundle), adapter_id, out)
    except CompressError as exc:
        _fail(err, exc.code, exc.message, EXIT_INVALID)
    if json_out:
        sys.stdout.write(json.dumps(info) + "\n")
    else:
        Console().print(f"exported {adapter_id} ({info['modules']} modules, rank {info['rank']}) to {out}")
