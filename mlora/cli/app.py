"""Typer application behind the ``mlora`` console script.

Conventions (README "CLI"): human output on stdout by default; ``--json``
makes stdout carry only the result (one JSON object per line); notes and
progress go to stderr and are off with ``--quiet`` or when stderr is not a
terminal. Errors print ``Error: ...`` and exit non-zero; tracebacks only with
``MLORA_DEBUG=1``.

Exit codes: 0 success, 1 invalid input or validation failure, 2 usage error,
3 runtime failure.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from mlora import __version__
from mlora.cli import render
from mlora.cli.batch_run import batch_run
from mlora.cli.bench import bench_app
from mlora.cli.compress import compress_app
from mlora.cli.release import merge, release_app, unmerge
from mlora.lora_tools import BaseLoadError, inspect_paths
from mlora.lora_tools.manifest import base_identity, load_base

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_RUNTIME = 0, 1, 2, 3

app = typer.Typer(
    name="mlora",
    help="Run many LoRA adapters over one shared base model.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: whole option names at 80 columns, brackets kept
)
app.add_typer(bench_app, name="bench")
# short_help: the root's command list shows one line per command, whole at 80 columns
app.command("batch-run", short_help="Generate a completion per Parquet row with its adapter.")(batch_run)
app.add_typer(compress_app, name="compress", short_help="Compress adapters into a collection bundle.")
app.command("merge", short_help="Merge adapters into a new immutable base revision.")(merge)
app.command("unmerge", short_help="Subtract merged adapters into a new release.")(unmerge)
app.add_typer(release_app, name="release")
out = Console(soft_wrap=True)
if not out.is_terminal and "COLUMNS" not in os.environ:
    out.width = 140  # logs and pipes: no terminal to fit, keep tables on one line each
err = Console(stderr=True)

PathsArg = typer.Argument(..., exists=True, metavar="PATH", help="Adapter directories, or directories of adapter directories.")
BaseOpt = typer.Option(None, "--base", exists=True, file_okay=False, help="Base checkpoint directory to check against and bind identities to.")
JsonOpt = typer.Option(False, "--json", help="Print one JSON manifest per adapter on stdout, nothing else.")
PickleOpt = typer.Option(False, "--allow-pickle", help="Read adapter_model.bin with torch.load(weights_only=True).")
QuietOpt = typer.Option(False, "--quiet", "-q", help="No notes or progress on stderr.")
WorkersOpt = typer.Option(None, "--workers", min=1, help="Hashing threads (default: all cores).")


def _version(value: bool) -> None:
    if value:
        out.print(f"mlora {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """mlora: validate, hash, compress, merge and batch-run LoRA adapters."""


def _progress(quiet: bool, what: str):
    return err.status(what) if not quiet and err.is_terminal else nullcontext()


def _inspect(paths, base, allow_pickle, workers, quiet):
    with _progress(quiet, "Reading and hashing adapters..."):
        try:
            return inspect_paths([str(p) for p in paths], str(base) if base else None, allow_pickle, workers)
        except BaseLoadError as exc:
            _base_error(exc)


def _base_error(exc: BaseLoadError):
    err.print(f"Error: {exc.finding.code}: {exc.finding.message}", markup=False, highlight=False)
    raise typer.Exit(EXIT_INVALID) from None


@app.command(short_help="Check adapters: structure, values, fit to a base, servability.")
def validate(
    paths: List[Path] = PathsArg,
    base: Optional[Path] = BaseOpt,
    json_out: bool = JsonOpt,
    strict: bool = typer.Option(False, "--strict", help="Fail on warnings too."),
    allow_pickle: bool = PickleOpt,
    workers: Optional[int] = WorkersOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Check PEFT LoRA adapters: structure, config, values, fit to a base, servability.

    Exit 0 when every adapter is valid and servable (with --strict: and has no
    warning), 1 otherwise.
    """
    reports, base_id = _inspect(paths, base, allow_pickle, workers, quiet)
    if json_out:
        for r in reports:
            sys.stdout.write(json.dumps(r.manifest, sort_keys=True) + "\n")
    else:
        render.validation(out, reports, base_id)
    raise typer.Exit(EXIT_OK if all(r.passes(strict) for r in reports) else EXIT_INVALID)


@app.command("hash", short_help="Print the content identities of adapters or a base.")
def hash_(
    paths: Optional[List[Path]] = typer.Argument(
        None, exists=True, metavar="PATH", help="Adapter directories, or directories of adapter directories."
    ),
    base: Optional[Path] = BaseOpt,
    json_out: bool = JsonOpt,
    allow_pickle: bool = PickleOpt,
    workers: Optional[int] = WorkersOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Print content identities: `artifact_sha256  semantic_sha256  path` per adapter.

    semantic_sha256 binds the base given with --base, or else the base the
    adapter declares (see docs/identity.md). With --base and no PATH, print the
    base identity: `base_sha256  path`. Exit 1 if any adapter is invalid.
    """
    if not paths:
        if base is None:
            render.fail(err, "E_USAGE", "give at least one adapter PATH, or --base DIR to hash a base checkpoint",
                        EXIT_USAGE)
        _hash_base(base, json_out, workers, quiet)
        return
    reports, _ = _inspect(paths, base, allow_pickle, workers, quiet)
    failed = False
    for r in reports:
        m = r.manifest
        if not m["valid"]:
            failed = True
            first = next((f for f in r.findings if f.severity == "error"), None)
            why = f"{first.code}: {first.message}" if first else "invalid"
            err.print(f"Error: {r.artifact.path}: {why}", markup=False, highlight=False)
            continue
        if json_out:
            sys.stdout.write(json.dumps(m, sort_keys=True) + "\n")
        else:
            sys.stdout.write(f"{m['artifact_sha256']}  {m['semantic_sha256']}  {r.artifact.path}\n")
    if not base and not quiet and err.is_terminal and not json_out and any(r.valid for r in reports):
        err.print("note: semantic_sha256 is bound to each adapter's declared base; pass --base to bind the real one.")
    raise typer.Exit(EXIT_INVALID if failed else EXIT_OK)


def _hash_base(base: Path, json_out: bool, workers: Optional[int], quiet: bool) -> None:
    with _progress(quiet, "Hashing base checkpoint..."):
        try:
            identity = base_identity(load_base(str(base)), workers)
        except BaseLoadError as exc:
            _base_error(exc)
    if json_out:
        sys.stdout.write(json.dumps({"schema_version": 1, "kind": "mlora.base_identity", "path": os.path.abspath(base),
                                     **identity.to_json()}, sort_keys=True) + "\n")
    else:
        sys.stdout.write(f"{identity.base_sha256}  {base}\n")


def main() -> None:
    """Console-script entry: Typer handles usage errors (exit 2) and exits;
    anything uncaught becomes ``Error: ...`` and exit 3 unless MLORA_DEBUG=1."""
    try:
        app()
    except Exception as exc:
        if os.environ.get("MLORA_DEBUG") == "1":
            raise
        err.print(f"Error: {type(exc).__name__}: {exc} (set MLORA_DEBUG=1 for a traceback)", markup=False)
        sys.exit(EXIT_RUNTIME)


if __name__ == "__main__":
    main()
