"""Exit codes, command by command, against the README's table ("## Exit codes").

Each command runs with a usage error (2), an invalid input (1) and, where cheap, success
(0); every exit code must be what the case expects and a code the README's row for that
command describes. The table must have one row per command (every ``bench`` command
shares one row)."""

import json
import os
import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from conftest import DEMO, REPO
from typer.testing import CliRunner

from mlora.cli.app import app
from mlora.lora_tools.release import MergeAdapter, merge

BASE, ADAPTERS = os.path.join(DEMO, "base"), os.path.join(DEMO, "adapters")
UPPER, ROT13 = os.path.join(ADAPTERS, "upper"), os.path.join(ADAPTERS, "rot13")


def readme_exit_table() -> dict[str, dict[int, str]]:
    """command -> {exit code: what the README says it means} ("-" or empty: never)."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        section = f.read().split("\n## Exit codes\n", 1)[1].split("\n## ", 1)[0]
    lines = [line.strip() for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[0] == "command", header
    codes = [int(c) for c in header[1:]]
    table = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(header), line
        table[cells[0].strip("`")] = {code: cell for code, cell in zip(codes, cells[1:])}
    return table


def _row_of(path: tuple[str, ...]) -> str:
    return path[0] if path[0] in ("bench", "compress") else " ".join(path)  # one row per group


def _leaves(cmd, path=()):
    subs = getattr(cmd, "commands", None)
    if subs is None:
        yield path
        return
    for name, sub in subs.items():
        yield from _leaves(sub, path + (name,))


def test_the_table_has_one_row_per_command():
    commands = {_row_of(p) for p in _leaves(typer.main.get_command(app))}
    assert set(readme_exit_table()) == commands


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A broken adapter (unparsable config), a tiny batch input, and paths to write."""
    root = tmp_path_factory.mktemp("exits")
    bad = root / "bad"
    shutil.copytree(UPPER, bad)
    (bad / "adapter_config.json").write_text("{")
    alora = root / "alora"  # valid and servable, but neither mergeable nor compressible
    shutil.copytree(UPPER, alora)
    config = json.loads((alora / "adapter_config.json").read_text())
    (alora / "adapter_config.json").write_text(json.dumps({**config, "alora_invocation_tokens": [5, 6]}))
    inp = root / "in.parquet"
    pq.write_table(pa.table({"id": ["b", "u"], "prompt": ["<|bos|>hi="] * 2, "adapter": [None, "upper"]}), inp)
    (root / "catalog.json").write_text(json.dumps({"upper": UPPER}))
    merge(BASE, [MergeAdapter(UPPER)], str(root / "release"))  # for unmerge and verify, whatever runs first
    return dict(root=root, bad=str(bad), alora=str(alora), input=str(inp), catalog=str(root / "catalog.json"))


def _job(ws, out, *extra):
    return ["batch-run", ws["input"], str(ws["root"] / out), "--base", BASE, "--adapters", ADAPTERS,
            "--max-new-tokens", "2", "--device", "cpu", "--quiet", *extra]


# command row -> [(case, args(ws), expected exit code)], run in order (a later case may use an earlier
# case's output of the same command; commands share only the fixture's files)
CASES = {
    "validate": [
        ("valid", lambda w: ["validate", UPPER, "--base", BASE], 0),
        ("aLoRA adapter", lambda w: ["validate", w["alora"], "--base", BASE, "--strict"], 0),
        ("broken adapter", lambda w: ["validate", w["bad"]], 1),
        ("missing PATH", lambda w: ["validate", str(w["root"] / "absent")], 2),
        ("--workers 0", lambda w: ["validate", UPPER, "--workers", "0"], 2),
    ],
    "hash": [
        ("adapter", lambda w: ["hash", UPPER], 0),
        ("base", lambda w: ["hash", "--base", BASE], 0),
        ("broken adapter", lambda w: ["hash", w["bad"]], 1),
        ("no PATH, no --base", lambda w: ["hash"], 2),
    ],
    "compress": [
        ("bundle", lambda w: ["compress", "fit", UPPER, ROT13, "--rank", "2", "--max-error", "100", "-o",
                              str(w["root"] / "bundle"), "--quiet"], 0),
        ("inspect", lambda w: ["compress", "inspect", str(w["root"] / "bundle")], 0),
        ("over --max-error", lambda w: ["compress", "fit", UPPER, ROT13, "--rank", "1", "--max-error", "0.001", "-o",
                                        str(w["root"] / "b2"), "--quiet"], 1),
        ("not a bundle", lambda w: ["compress", "inspect", BASE], 1),
        ("aLoRA member", lambda w: ["compress", "fit", UPPER, w["alora"], "-o", str(w["root"] / "b4"), "--quiet"], 1),
        ("--rank 0", lambda w: ["compress", "fit", UPPER, "--rank", "0", "-o", str(w["root"] / "b3")], 2),
        ("--clusters abc", lambda w: ["compress", "fit", UPPER, "--clusters", "abc", "-o", str(w["root"] / "b3")], 2),
        ("--clusters 0", lambda w: ["compress", "fit", UPPER, "--clusters", "0", "-o", str(w["root"] / "b3")], 2),
        ("no -o", lambda w: ["compress", "fit", UPPER], 2),
    ],
    "merge": [
        ("release", lambda w: ["merge", "--base", BASE, "--adapter", UPPER, "-o", str(w["root"] / "rel"), "-q"], 0),
        ("existing -o", lambda w: ["merge", "--base", BASE, "--adapter", UPPER, "-o", str(w["root"] / "rel"), "-q"], 1),
        ("broken adapter", lambda w: ["merge", "--base", BASE, "--adapter", w["bad"], "-o", str(w["root"] / "r2"),
                                      "-q"], 1),
        ("aLoRA adapter", lambda w: ["merge", "--base", BASE, "--adapter", w["alora"], "-o", str(w["root"] / "r2"),
                                     "-q"], 1),
        ("--dtype", lambda w: ["merge", "--base", BASE, "--adapter", UPPER, "-o", str(w["root"] / "r3"), "--dtype",
                               "f8", "-q"], 2),
        ("--weight count", lambda w: ["merge", "--base", BASE, "--adapter", UPPER, "--weight", "1", "--weight", "2",
                                      "-o", str(w["root"] / "r3"), "-q"], 2),
        ("no --adapter", lambda w: ["merge", "--base", BASE, "-o", str(w["root"] / "r3")], 2),
    ],
    "unmerge": [
        ("release", lambda w: ["unmerge", "--release", str(w["root"] / "release"), "-o", str(w["root"] / "un")], 0),
        ("not a release", lambda w: ["unmerge", "--release", BASE, "-o", str(w["root"] / "un2")], 1),
        ("missing --release", lambda w: ["unmerge", "--release", str(w["root"] / "absent"), "-o",
                                         str(w["root"] / "un2")], 2),
    ],
    "release verify": [
        ("intact", lambda w: ["release", "verify", str(w["root"] / "release")], 0),
        ("not a release", lambda w: ["release", "verify", BASE], 1),
        ("missing RELEASE", lambda w: ["release", "verify", str(w["root"] / "absent")], 2),
    ],
    "batch-run": [
        ("job", lambda w: _job(w, "out"), 0),
        ("finished job resumed", lambda w: _job(w, "out", "--resume"), 0),
        ("existing OUTPUT", lambda w: _job(w, "out"), 1),
        ("missing column", lambda w: _job(w, "o2", "--prompt-column", "text"), 1),
        ("missing INPUT", lambda w: ["batch-run", str(w["root"] / "absent.parquet"), str(w["root"] / "o3"), "--base",
                                     BASE, "--quiet"], 2),
        ("--kv-cache-gb -1", lambda w: _job(w, "o3", "--kv-cache-gb", "-1"), 2),
        ("--gpu-memory-utilization 2", lambda w: _job(w, "o3", "--gpu-memory-utilization", "2"), 2),
        ("--adapters and --catalog", lambda w: _job(w, "o3", "--catalog", w["catalog"]), 2),
        ("--num-workers 0", lambda w: _job(w, "o3", "--num-workers", "0"), 2),
    ],
    "bench": [
        ("bench hash", lambda w: ["bench", "hash", UPPER, "--runs", "1"], 0),
        ("bench hash without paths", lambda w: ["bench", "hash"], 2),
        ("unknown preset", lambda w: ["bench", "batch", "--preset", "nope", "--device", "cpu"], 2),
        ("unknown dtype", lambda w: ["bench", "residency", str(w["root"] / "w"), "--preset", "tiny", "--device",
                                     "cpu", "--dtype", "f8"], 2),
        ("unknown prefix job", lambda w: ["bench", "prefix", "--preset", "tiny", "--device", "cpu", "--jobs", "x"], 2),
        ("tp size not dividing the workers", lambda w: ["bench", "gpus", str(w["root"] / "g"), "--preset", "tiny",
                                                        "--device", "cpu", "--num-workers", "3",
                                                        "--tensor-parallel-size", "2"], 2),
    ],
}


def test_every_command_has_cases():
    assert set(CASES) == set(readme_exit_table())
    for command, cases in CASES.items():
        codes = {code for _, _, code in cases}
        assert 2 in codes, command  # a usage error
        assert 1 in codes or command == "bench", command  # an invalid input (bench: none is cheap)


@pytest.mark.parametrize("command", sorted(CASES))
def test_exit_codes_agree_with_the_readme(command, ws):
    described = readme_exit_table()[command]
    for case, args, expected in CASES[command]:
        result = CliRunner().invoke(app, args(ws))
        if result.exception and not isinstance(result.exception, SystemExit):
            raise result.exception
        assert result.exit_code == expected, (command, case, result.exit_code, result.stderr)
        assert described.get(expected, "-") not in ("", "-", "—"), (command, case, expected)
        if expected == 1 and command == "validate":  # the report says which adapter failed
            assert "0/1 adapter(s) valid and servable" in result.stdout, (case, result.stdout)
        elif expected:
            errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
            assert len(errors) == 1, (command, case, result.stderr)
            if not result.stderr.startswith("Usage: "):  # click's own usage errors carry no code
                assert re.search(r"\bE_[A-Z0-9_]+: ", errors[0]), (command, case, errors[0])
