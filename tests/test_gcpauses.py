"""gcpauses: the collector's pauses counted by generation while installed (GcPauses), and over one
run (RunPauses)."""

import gc

from mlora.batch.gcpauses import PAUSES, GcPauses, RunPauses


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


def test_run_pauses_count_from_start_and_are_fixed_by_close():
    """RunPauses: nothing before ``start``; collections by generation and the longest pause
    from then on; after ``close`` the figures stay as they were and the callback is gone
    (unless another holder keeps it)."""
    p = RunPauses()
    assert p.stats() == {}
    gc.collect()
    p.start()
    try:
        gc.collect(1)
        live = p.stats()
        assert set(live) == {"gc_collections", "gc_pause_seconds", "gc_pause_max_ms"}
        assert live["gc_collections"]["1"] >= 1 and live["gc_pause_max_ms"] > 0
    finally:
        p.close()
    closed = p.stats()
    assert closed["gc_collections"]["1"] >= 1
    gc.collect(1)
    assert p.stats() == closed
    assert PAUSES._callback not in gc.callbacks
    p.close()  # idempotent
