"""gcpauses: the collector's pauses counted by generation while installed (GcPauses), MLORA_GC, and the
device-wait collector."""

import gc

import pytest

from mlora.batch.gcpauses import GcPauses, gc_mode


def test_collections_are_counted_by_generation_while_installed():
    p = GcPauses()
    gc.collect()
    p.install()
    p.install()  # nested holders: one callback
    assert gc.callbacks.count(p._callback) == 1
    try:
        snap = p.snapshot()
        gc.collect(0)
        gc.collect(2)
        d = p.since(snap)
        assert d["gc_collections"]["0"] >= 1 and d["gc_collections"]["2"] >= 1
        assert d["gc_pause_seconds"]["2"] > 0 and p.total() >= sum(d["gc_pause_seconds"].values()) - 1e-6
        assert 0 < d["gc_pause_max_ms"] <= 1e3 * p.total() + 1e-3
        p.uninstall()
        assert gc.callbacks.count(p._callback) == 1  # one holder left
    finally:
        p.uninstall()
    assert p._callback not in gc.callbacks
    before = p.snapshot()
    gc.collect()
    assert p.snapshot() == before  # not installed: nothing counted
    p.uninstall()  # more uninstalls than installs: harmless


def test_gc_mode_knob(monkeypatch):
    monkeypatch.delenv("MLORA_GC", raising=False)
    assert gc_mode() == "default"
    monkeypatch.setenv("MLORA_GC", "freeze")
    assert gc_mode() == "freeze"
    monkeypatch.setenv("MLORA_GC", "off")
    with pytest.raises(ValueError, match="MLORA_GC='off'"):
        gc_mode()


def test_device_wait_collector_runs_what_python_would_at_its_calls():
    """DeviceWaitCollector: automatic collection off; each call runs generation 0 once the
    allocation count reached threshold0, every threshold1-th of those generation 1, every
    threshold2-th of those generation 2; nothing below the threshold; close re-enables."""
    from mlora.batch.gcpauses import DeviceWaitCollector

    saved = gc.get_threshold()
    was = gc.isenabled()
    gc.enable()
    gc.set_threshold(50, 3, 2)
    try:
        c = DeviceWaitCollector()
        assert not gc.isenabled()
        gc.collect()
        c()  # count below threshold0: nothing
        assert c.ran == [0, 0, 0]
        keep = []
        for _ in range(6):
            keep.append([[] for _ in range(80)])  # 80 live containers: past threshold0
            assert gc.get_count()[0] >= 50
            c()
            assert gc.get_count()[0] < 50  # collected
        assert c.ran == [4, 1, 1], c.ran  # calls 3 and 6 were generation 1; the second of those generation 2
        c.close()
        assert gc.isenabled()
    finally:
        gc.set_threshold(*saved)
        (gc.enable if was else gc.disable)()
