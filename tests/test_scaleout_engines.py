"""Several engines, one job (mlora/batch/scaleout/engines.py): engine reports merged into the
job's metrics and summary, and a Ray actor's cumulative reports kept latest-per-actor. No Ray,
no model: engines are JobMetrics fed by hand."""

from types import SimpleNamespace

from mlora.batch.job.metrics import JobMetrics
from mlora.batch.scaleout.engines import EngineReport, LatestReports, encode_report, merge_reports, merge_stats


def _pinned(nbytes: int):
    """A stand-in for a PinnedAdapter whose stored factors take ``nbytes`` bytes."""
    half = SimpleNamespace(nbytes=nbytes // 2)
    return SimpleNamespace(modules=[SimpleNamespace(a=half, b=half)])


PINNED = {"x": _pinned(1000), "y": _pinned(600)}


def _engine(iterations: int, loads: int) -> JobMetrics:
    m = JobMetrics(clock=lambda: 0.0)
    for _ in range(iterations):
        m.iteration(prefill_tokens=3, decode_tokens=2, distinct_adapters=1, rank_rows_true=8, rank_rows_padded=8,
                    seconds=0.01)
    for _ in range(loads):
        m.adapter_load(bytes_h2d=1000, seconds=0.001, ok=True, tier_from="disk")
    m.prefix_cache(looked_up=2, hit=1, evicted=0, published=1, shared=iterations)
    return m


def _report(m: JobMetrics, used: list[str], rows: int, tokens: int) -> EngineReport:
    return EngineReport(m.engine_state(), used, {"iterations": m.iterations, "generated_tokens": tokens,
                                                 "device": "cpu"}, {"loads": sum(m.loads.values())}, rows, tokens)


def test_each_actor_is_absorbed_once_from_its_latest_report():
    """Cumulative reports arrive out of order and twice: the job absorbs actor a's second report
    and actor b's only one, once each (counters add, the prefix peak is the larger engine's)."""
    a, b = _engine(1, 1), _engine(0, 1)
    a1 = encode_report("a", 1, _report(a, ["x"], 8, 10))
    a.iteration(prefill_tokens=0, decode_tokens=4, distinct_adapters=2, rank_rows_true=8, rank_rows_padded=16,
                seconds=0.02)
    a.adapter_load(bytes_h2d=600, seconds=0.001, ok=True, tier_from="disk")
    a.prefix_cache(looked_up=0, hit=0, evicted=0, published=0, shared=3)
    a2 = encode_report("a", 2, _report(a, ["x", "y"], 16, 30))
    b1 = encode_report("b", 1, _report(b, ["y"], 8, 7))
    latest = LatestReports()
    for text in (b1, a2, b1, a1):  # a1 after a2: stale
        latest.add(text)
    reports = latest.reports()
    assert [(r.rows, r.generated_tokens) for r in reports] == [(8, 7), (16, 30)]  # b first: seen first

    job = JobMetrics(clock=lambda: 0.0)
    engine, bank = merge_reports(job, PINNED, reports)
    s = job.snapshot()
    assert s["iterations"] == 2 and s["prefill_tokens"] == 3 and s["decode_tokens"] == 6
    assert s["adapter_loads"]["disk"] == 3 and s["h2d_bytes"] == 2600
    assert s["unique_adapter_bytes"] == 1600  # x and y once each, though b used y too
    assert s["histograms"]["iteration_seconds"]["count"] == 2 and s["rank_padded_row_values"] == 24
    assert s["prefix_cache"]["looked_up_blocks"] == 4 and s["prefix_cache"]["shared_blocks_peak"] == 3
    assert engine == {"iterations": 2, "generated_tokens": 37, "device": "cpu"} and bank == {"loads": 3}


def test_a_report_survives_its_json_form():
    """Absorbing an engine's state sent as JSON (histograms' tuples become lists) gives the
    same job figures as absorbing the state itself."""
    m = _engine(3, 2)
    direct, sent = JobMetrics(clock=lambda: 0.0), JobMetrics(clock=lambda: 0.0)
    merge_reports(direct, PINNED, [_report(m, ["x"], 4, 4)])
    latest = LatestReports()
    latest.add(encode_report("a", 1, _report(m, ["x"], 4, 4)))
    merge_reports(sent, PINNED, latest.reports())
    assert sent.snapshot() == direct.snapshot() and sent.prometheus_text() == direct.prometheus_text()


def test_engine_and_bank_stats_merge_by_what_each_figure_is():
    """Counters add, maxima and peaks take the largest engine's, per-load means are weighted by
    each engine's loads, percentiles take the slowest engine's, nested counters add, per-rank
    lists join, labels stay the first engine's."""
    a = {"loads": 1, "load_copy_ms_mean": 4.0, "load_copy_ms_p90": 4.0, "gc_pause_max_ms": 2.0,
         "pinned_pool_peak_blocks": 3, "gc_collections": {"0": 2, "1": 0}, "follower_host_cache_hits": [5],
         "device": "cuda:0"}
    b = {"loads": 3, "load_copy_ms_mean": 8.0, "load_copy_ms_p90": 9.0, "gc_pause_max_ms": 1.0,
         "pinned_pool_peak_blocks": 2, "gc_collections": {"0": 1, "1": 1}, "follower_host_cache_hits": [7],
         "device": "cuda:1"}
    assert merge_stats([a, b]) == {
        "loads": 4, "load_copy_ms_mean": 7.0, "load_copy_ms_p90": 9.0, "gc_pause_max_ms": 2.0,
        "pinned_pool_peak_blocks": 3, "gc_collections": {"0": 3, "1": 1}, "follower_host_cache_hits": [5, 7],
        "device": "cuda:0"}
    assert merge_stats([a]) == a
