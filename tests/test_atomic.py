"""Immutable output directories (mlora.lora_tools.atomic): the final rename never replaces a
path that appeared after the last look, and every file mlora writes takes the user's umask."""

import os
import stat

import factory
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import DEMO

from mlora.lora_tools import atomic


class Exists(Exception):
    pass


def _exists(path, during):
    return Exists(path, during)


def _first_writer(out, kind):
    """What another writer (or a user) leaves at ``out``."""
    if kind == "release":
        os.mkdir(out)
        with open(os.path.join(out, "who"), "w") as f:
            f.write("first")
    elif kind == "empty":
        os.mkdir(out)
    else:
        with open(out, "w") as f:
            f.write("first")


def _looks_away(monkeypatch, out):
    """This writer's last look at ``out`` happened before the first writer's rename landed."""
    real = os.path.lexists
    monkeypatch.setattr(os.path, "lexists", lambda p: False if os.path.abspath(p) == out else real(p))


@pytest.mark.parametrize("noreplace_call", [True, False], ids=["renameat2", "mkdir-then-rename"])
@pytest.mark.parametrize("kind", ["release", "empty", "file"])
def test_a_path_that_appears_before_the_final_rename_is_never_replaced(tmp_path, monkeypatch, kind, noreplace_call):
    if not noreplace_call:
        monkeypatch.setattr(atomic, "_renameat2", None)
    out = str(tmp_path / "rel")
    with pytest.raises(Exists) as e:
        with atomic.atomic_directory(out, _exists) as tmp:
            with open(os.path.join(tmp, "who"), "w") as f:
                f.write("second")
            _first_writer(out, kind)
            _looks_away(monkeypatch, out)
    assert e.value.args == (out, True)  # the caller's "appeared while writing" error
    if kind == "release":
        assert open(os.path.join(out, "who")).read() == "first"
    elif kind == "empty":
        assert os.listdir(out) == []
    else:
        assert open(out).read() == "first"
    assert os.listdir(tmp_path) == ["rel"]  # the second writer's temporary is gone


def test_rename_noreplace_moves_a_directory_onto_a_free_path(tmp_path, monkeypatch):
    for way in ("renameat2", "mkdir-then-rename"):
        if way != "renameat2":
            monkeypatch.setattr(atomic, "_renameat2", None)
        src, dst = tmp_path / f"src-{way}", tmp_path / f"dst-{way}"
        src.mkdir()
        (src / "x").write_text(way)
        atomic.rename_noreplace(str(src), str(dst))
        assert not src.exists() and (dst / "x").read_text() == way


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def _modes(path):
    return {e: stat.S_IMODE(os.stat(os.path.join(path, e)).st_mode) for e in os.listdir(path)}


def test_atomic_directories_take_the_umask(tmp_path, umask_027):
    for read_only, want in ((False, 0o640), (True, 0o440)):
        out = str(tmp_path / f"ro-{read_only}")
        with atomic.atomic_directory(out, _exists, read_only=read_only) as tmp:
            open(os.path.join(tmp, "a.json"), "w").close()
            os.close(os.open(os.path.join(tmp, "b.bin"), os.O_CREAT | os.O_WRONLY, 0o600))  # as safetensors does
        assert _modes(out) == {"a.json": want, "b.bin": want}
        assert stat.S_IMODE(os.stat(out).st_mode) == 0o750


def test_merge_compress_and_export_write_with_the_umask(tmp_path, umask_027, run_cli):
    from mlora.compress.bundle import CompressOptions, compress, export_member, read_bundle, write_bundle
    from mlora.compress.collection import load_collection

    base = str(tmp_path / "base")
    factory.save_base(factory.tiny_model("llama", seed=0), base)
    for name, seed in (("a", 1), ("b", 2)):
        factory.make_adapters(str(tmp_path / "adapters"), base, {name: dict(r=2, lora_alpha=4, seed=seed)})
    assert run_cli("merge", "--base", base, "--adapter", tmp_path / "adapters" / "a", "-o", tmp_path / "rel")[0] == 0
    assert set(_modes(tmp_path / "rel").values()) == {0o440}
    assert stat.S_IMODE(os.stat(tmp_path / "rel").st_mode) == 0o750

    col = load_collection([str(tmp_path / "adapters")], base)
    write_bundle(compress(col, CompressOptions(rank=2, max_error=1.0)), str(tmp_path / "bundle"))
    assert set(_modes(tmp_path / "bundle").values()) == {0o440}
    export_member(read_bundle(str(tmp_path / "bundle")), "a", str(tmp_path / "export"))
    assert _modes(tmp_path / "export") == {"adapter_model.safetensors": 0o640, "adapter_config.json": 0o640}
    assert stat.S_IMODE(os.stat(tmp_path / "export").st_mode) == 0o750


def test_batch_run_output_files_take_the_umask(tmp_path, umask_027, run_cli):
    prompts = pq.read_table(os.path.join(DEMO, "prompts.parquet")).slice(0, 2)
    pq.write_table(pa.table({"id": prompts["id"], "prompt": prompts["prompt"],
                             "adapter": pa.array([None, None], pa.string())}), tmp_path / "in.parquet")
    code, _, stderr = run_cli("batch-run", tmp_path / "in.parquet", tmp_path / "out", "--base",
                              os.path.join(DEMO, "base"), "--max-new-tokens", 2, "--device", "cpu", "-q")
    assert code == 0, stderr
    modes = _modes(tmp_path / "out")
    assert len(modes) >= 3 and set(modes.values()) == {0o640}, modes
    assert stat.S_IMODE(os.stat(tmp_path / "out").st_mode) == 0o750
