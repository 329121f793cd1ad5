"""Human rendering of validation reports with rich. No logic beyond layout."""

from __future__ import annotations

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from mlora.lora_tools import AdapterReport, BaseIdentity

_SEVERITY_STYLE = {"error": "bold red", "unservable": "yellow", "warning": "magenta", "info": "cyan"}


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _collapse(findings, keep: int = 3):
    """Show at most ``keep`` findings of one code; the last shown one carries
    the count of the rest (the JSON manifest keeps every finding)."""
    by_code: dict[str, list] = {}
    for f in findings:
        by_code.setdefault(f.code, []).append(f)
    for group in by_code.values():
        if len(group) <= keep:
            yield from ((f, 1) for f in group)
        else:
            yield from ((f, 1) for f in group[: keep - 1])
            yield group[keep - 1], len(group) - keep + 2


def validation(console: Console, reports: list[AdapterReport], base: BaseIdentity | None) -> None:
    """One summary row per adapter, then every finding grouped by adapter."""
    title = "Adapters" + (f" against base {base.base_sha256[:12]}" if base else "")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1),
                  collapse_padding=True, pad_edge=False)
    # "ranks" reads rank x module count: "16x28" = 28 modules at rank 16; it wraps between entries
    # and never narrower than its longest entry, the adapter name folds (80 columns hold the rest)
    ranks_of = {id(r): [f"{k}x{v}" for k, v in r.manifest["stats"]["rank_histogram"].items()] or ["-"]
                for r in reports}
    widest = max((len(x) for entries in ranks_of.values() for x in entries), default=1)
    for col in ("adapter", "modules", "ranks", "params", "bytes", "artifact", "valid", "servable"):
        table.add_column(col, justify="right" if col in ("modules", "params", "bytes") else "left",
                         no_wrap=col not in ("adapter", "ranks"), overflow="fold",
                         min_width=max(len(col), widest) if col == "ranks" else len(col))
    for r in reports:
        m = r.manifest
        ranks = " ".join(ranks_of[id(r)])
        table.add_row(
            m["name"],
            str(m["stats"]["modules"]),
            ranks,
            f"{m['stats']['parameters']:,}",
            _size(m["stats"]["bytes"]),
            (m["artifact_sha256"] or "-")[:12],
            "[green]yes[/]" if m["valid"] else "[bold red]no[/]",
            "[green]yes[/]" if m["servable"] else "[bold red]no[/]",
        )
    console.print(table)
    for r in reports:
        if not r.findings:
            continue
        ft = Table(title=f"Findings: {r.manifest['name']} ({r.artifact.path})", title_justify="left", show_lines=False)
        ft.add_column("code")
        ft.add_column("severity")
        ft.add_column("module")
        ft.add_column("message", overflow="fold")
        for f, count in _collapse(r.findings):
            style = _SEVERITY_STYLE.get(f.severity, "")
            module = f.module or "-"
            if count > 1:
                module = f"{module} and {count - 1} more"
            ft.add_row(f"[{style}]{f.code}[/]", f.severity, module, f.message)
        console.print(ft)
    ok = sum(r.valid and r.servable for r in reports)
    console.print(f"{ok}/{len(reports)} adapter(s) valid and servable.")


def fail(err: Console, code: str, message: str, exit_code: int = 1):
    """Print ``Error: CODE: message`` on stderr and exit: no markup (messages quote paths and
    lists), one line (the terminal wraps it; a log keeps paths and values whole)."""
    err.print(f"Error: {code}: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(exit_code)
