"""The `mlora compress` command line: `fit`, `inspect` and `export` are sub-commands, so a directory
named like one of them is read as a path wherever the grammar places a path."""

import json
import os

from test_compress_bundle import base, shared_collection  # noqa: F401 (the module-scoped base fixture)

from mlora.compress.bundle import read_bundle


def test_help_lists_the_sub_commands(run_cli):
    code, stdout, _ = run_cli("compress", "--help")
    assert code == 0
    for sub in ("fit", "inspect", "export"):
        assert any(line.strip(" │").startswith(sub + " ") for line in stdout.splitlines()), (sub, stdout)
    code, stdout, _ = run_cli("--help")
    assert code == 0 and "compress" in stdout


def test_adapter_directories_named_inspect_and_export_are_adapters(tmp_path, base, run_cli, monkeypatch):
    src = tmp_path / "src"
    shared_collection(str(src), base, n=3)
    os.rename(src / "a0", src / "inspect")
    os.rename(src / "a1", src / "export")
    monkeypatch.chdir(src)
    code, stdout, stderr = run_cli("compress", "fit", "inspect", "export", "a2", "-o", tmp_path / "b", "--rank", 3,
                                   "--json")
    assert code == 0, stderr
    assert read_bundle(str(tmp_path / "b")).member_ids() == ["inspect", "export", "a2"]
    # one adapter directory named inspect alone, relative, as the first and only path
    code, _, stderr = run_cli("compress", "fit", "inspect", "-o", tmp_path / "one", "--rank", 3)
    assert code == 0, stderr
    assert read_bundle(str(tmp_path / "one")).member_ids() == ["inspect"]


def test_bundle_and_output_directories_named_inspect_and_export(tmp_path, base, run_cli, monkeypatch):
    src = tmp_path / "src"
    shared_collection(str(src), base, n=2)
    os.rename(src / "a0", src / "inspect")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert run_cli("compress", "fit", src, "-o", "export", "--rank", 3)[0] == 0
    code, stdout, stderr = run_cli("compress", "inspect", "export", "--json")  # the bundle named export
    assert code == 0, stderr
    assert json.loads(stdout)["bundle_sha256"] == read_bundle(str(work / "export")).manifest["bundle_sha256"]
    # member `inspect` of the bundle `export`, written to a directory named `inspect`
    code, stdout, stderr = run_cli("compress", "export", "export", "inspect", "-o", "inspect", "--json")
    assert code == 0, stderr
    assert sorted(os.listdir(work / "inspect")) == ["adapter_config.json", "adapter_model.safetensors"]
    code, stdout, _ = run_cli("validate", work / "inspect", "--base", base, "--json")
    assert code == 0 and json.loads(stdout)["valid"]


def test_the_first_word_must_be_a_sub_command(tmp_path, base, run_cli):
    src = tmp_path / "src"
    shared_collection(str(src), base, n=2)
    code, _, stderr = run_cli("compress", src, "-o", tmp_path / "b", "--rank", 3)
    said = " ".join(stderr.replace("│", " ").split())  # the message as one line, out of its box
    assert code == 2 and "mlora compress fit ADAPTER... -o BUNDLE" in said and not (tmp_path / "b").exists()
    code, _, stderr = run_cli("compress", "export", tmp_path / "b", "a0")  # no -o: a usage error, nothing read
    assert code == 2 and "--output" in stderr
