"""Help and tables at 80 columns: every command's --help shows every option name whole,
keeps the brackets its texts hold, never cuts with an ellipsis and fits 80 columns; the
validate table shows every rank entry whole at 80 columns."""

import io
import os
import re

import pytest
import typer
from conftest import DEMO
from rich.console import Console
from typer.testing import CliRunner

from mlora.cli import render
from mlora.cli.app import app
from mlora.lora_tools import inspect_paths


def _commands(cmd=None, path=()):
    """(path, click command) of the root, every group and every leaf command."""
    cmd = cmd or typer.main.get_command(app)
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _commands(sub, path + (name,))


COMMANDS = {" ".join(p) or "(root)": (p, c) for p, c in _commands()}


def test_every_command_is_covered():
    assert {"batch-run", "validate", "hash", "compress", "merge", "unmerge", "release verify", "bench batch"} <= set(
        COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_reads_whole_at_80_columns(name):
    path, cmd = COMMANDS[name]
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    text = result.output
    assert "…" not in text
    assert all(len(line) <= 80 for line in text.splitlines()), max(text.splitlines(), key=len)
    words = " ".join(text.split())
    for param in cmd.params:
        for opt in [*param.opts, *param.secondary_opts]:
            if opt.startswith("-"):
                assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text), (name, opt)
        for token in re.findall(r"\S*\[[^\]\s]*\]\S*", getattr(param, "help", None) or ""):
            assert token in words, (name, param.name, token)  # a bracket the markup would eat
    for sub in getattr(cmd, "commands", {}):
        assert re.search(rf"^  {re.escape(sub)}\s", text, re.M), (name, sub)


def test_engine_help_keeps_the_ray_extra():
    result = CliRunner().invoke(app, ["batch-run", "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert "pip install 'mlora[ray]'" in " ".join(result.output.split())


def test_validate_table_shows_whole_ranks_at_80_columns():
    reports, base = inspect_paths([os.path.join(DEMO, "adapters")], os.path.join(DEMO, "base"))
    buf = io.StringIO()
    render.validation(Console(file=buf, width=80, color_system=None), reports, base)
    text = buf.getvalue()
    assert "…" not in text
    assert all(len(line.rstrip()) <= 80 for line in text.splitlines())
    header = next(line for line in text.splitlines() if line.lstrip().startswith("adapter"))
    assert header.split() == ["adapter", "modules", "ranks", "params", "bytes", "artifact", "valid", "servable"]
    cells = set(text.split())
    for r in reports:
        assert r.manifest["name"] in cells
        for rank, count in r.manifest["stats"]["rank_histogram"].items():
            assert f"{rank}x{count}" in cells, (r.manifest["name"], rank, count)
