"""mlora.batch.job.metrics: the job's counters, derived figures and their two renderings."""

from __future__ import annotations

import json
import math
import os
import pickle

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlora.batch.job import metrics as metrics_mod
from mlora.batch.job.metrics import ERROR_CODES, LABEL_VALUES, PROM_NAME, RESIDENCY_STATES, JobMetrics


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def scripted(clock: Clock) -> JobMetrics:
    """The worked sequence every figure below is computed from by hand."""
    m = JobMetrics(clock=clock)
    m.row_finished("stop", prompt_tokens=10, completion_tokens=5)
    m.row_finished("length", prompt_tokens=4, completion_tokens=8)
    m.row_finished("error", "E_PROMPT_NULL")
    m.row_finished("error", "E_ADAPTER_LOAD", prompt_tokens=0)
    m.row_finished("error", "E_NOT_A_CODE_WE_KNOW")
    m.row_finished("stop", prompt_tokens=6, completion_tokens=7)
    m.iteration(prefill_tokens=14, decode_tokens=0, distinct_adapters=2, rank_rows_true=40, rank_rows_padded=64,
                seconds=0.5)
    m.iteration(prefill_tokens=0, decode_tokens=6, distinct_adapters=3, rank_rows_true=24, rank_rows_padded=24,
                seconds=0.25)
    m.iteration(prefill_tokens=6, decode_tokens=2, distinct_adapters=1, rank_rows_true=0, rank_rows_padded=0,
                seconds=0.25)
    m.adapter_load(3000, 0.002, True, "host")
    m.adapter_load(3000, 0.02, False, "disk")  # a failed attempt still moved its bytes
    m.adapter_load(3000, 0.003, True, "disk")
    m.adapter_load(1000, 0.0001, True, "host")
    m.unique_adapter_bytes(3000)
    m.unique_adapter_bytes(1000)
    for hit, tier in [(True, "device")] * 3 + [(False, "device"), (True, "host"), (False, "host")]:
        m.cache(hit, tier)
    m.eviction("device")
    m.eviction("device")
    m.eviction("host")
    m.residency_states({"published": 2, "active": 1, "host_ready": 4})
    m.residency_states({"idle": 3, "host_ready": 4})  # the latest counts replace the previous ones
    m.prefetch(4, 0)
    m.prefetch(0, 3)
    m.prefetch(4, 2)
    m.preemption()
    m.preemption()
    m.prefix_admission(reused=0, computed=14)  # the first row: nothing cached yet
    m.prefix_admission(reused=32, computed=6)
    m.prefix_cache(looked_up=3, hit=0, evicted=0, published=3, shared=0)
    m.prefix_cache(looked_up=5, hit=2, evicted=1, published=1, shared=2)
    m.prefix_cache(looked_up=0, hit=0, evicted=2, published=0, shared=1)  # the peak stays 2
    m.alora_without_invocation()
    m.row_finished("error", "E_ALORA_NO_INVOCATION")
    clock.now += 4.0
    return m


def prom_samples(text: bytes) -> dict:
    """{(sample name, frozenset(labels)): value} of a Prometheus text file."""
    out = {}
    for fam in text_string_to_metric_families(text.decode("utf-8")):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def test_scripted_sequence_counts_and_derived_figures():
    s = scripted(Clock(100.0)).snapshot()
    assert s["elapsed_s"] == 4.0
    assert s["rows_finished"] == 7
    assert s["finish_reasons"] == {"stop": 2, "length": 1, "error": 4}
    assert s["errors_by_code"] == {"E_ADAPTER_LOAD": 1, "E_ALORA_NO_INVOCATION": 1, "E_PROMPT_NULL": 1, "other": 1}
    assert (s["prompt_tokens"], s["completion_tokens"]) == (20, 20)
    assert s["tokens_per_s"] == 5.0  # 20 completion tokens / 4 s
    assert (s["iterations"], s["iteration_seconds"], s["prefill_tokens"], s["decode_tokens"]) == (3, 1.0, 20, 8)
    assert s["iteration_tokens_per_s"] == 28.0
    assert (s["rank_true_row_values"], s["rank_padded_row_values"]) == (64, 88)
    assert s["rank_padding_ratio"] == 1.375  # 88 / 64
    assert s["adapter_loads"] == {"disk": 2, "host": 2, "device": 0}
    assert s["adapter_load_failures"] == {"disk": 1, "host": 0, "device": 0}
    assert (s["h2d_bytes"], s["unique_adapter_bytes"]) == (10000, 4000)
    assert s["load_amplification"] == 2.5
    assert s["cache_hits"] == {"disk": 0, "host": 1, "device": 3}
    assert s["cache_misses"] == {"disk": 0, "host": 1, "device": 1}
    assert s["cache_hit_rate"] == {"disk": None, "host": 0.5, "device": 0.75}
    assert s["evictions"] == {"disk": 0, "host": 1, "device": 2}
    assert s["residency_states"] == {state: {"idle": 3, "host_ready": 4}.get(state, 0) for state in RESIDENCY_STATES}
    assert (s["prefetch_issued"], s["prefetch_used"], s["prefetch_precision"]) == (8, 5, 0.625)
    assert s["preemptions"] == 2
    assert (s["prefill_tokens_computed"], s["prefill_tokens_reused"]) == (20, 32)
    assert s["prefix_cache"] == {"hit_rate": 0.25, "hit_blocks": 2, "looked_up_blocks": 8, "evictions": 3,
                                 "published_blocks": 4, "shared_blocks_peak": 2}
    assert s["alora_rows_without_invocation"] == 1

    distinct = s["histograms"]["adapter_distinct_per_iteration"]
    assert (distinct["count"], distinct["sum"]) == (3, 6)
    assert [distinct["buckets"][le] for le in ("0.0", "1.0", "2.0", "4.0", "1024.0", "+Inf")] == [0, 1, 2, 3, 3, 3]
    assert list(distinct["buckets"])[-1] == "+Inf"
    host = s["histograms"]["adapter_load_latency_seconds"]["host"]
    assert host["count"] == 2 and host["sum"] == pytest.approx(0.0021)
    assert host["buckets"]["0.0001"] == 1  # a value equal to a bound counts in that bucket (le)
    assert host["buckets"]["0.001"] == 1 and host["buckets"]["0.0025"] == 2
    disk = s["histograms"]["adapter_load_latency_seconds"]["disk"]
    assert (disk["buckets"]["0.005"], disk["buckets"]["0.025"], disk["count"]) == (1, 2, 2)
    assert s["histograms"]["adapter_load_latency_seconds"]["device"]["count"] == 0
    assert s["histograms"]["iteration_seconds"]["buckets"]["0.25"] == 2


def test_undefined_ratios_are_null_in_json_and_nan_in_prometheus():
    m = JobMetrics(clock=Clock(7.0))
    s = m.snapshot()
    for key in ("tokens_per_s", "iteration_tokens_per_s", "rank_padding_ratio", "load_amplification",
                "prefetch_precision"):
        assert s[key] is None, key
    assert set(s["cache_hit_rate"].values()) == {None}
    assert s["prefix_cache"]["hit_rate"] is None  # nothing looked up
    assert (s["prefill_tokens_computed"], s["prefill_tokens_reused"], s["alora_rows_without_invocation"]) == (0, 0, 0)
    prom = prom_samples(m.prometheus_text())
    for name in ("mlora_adapter_load_amplification_ratio", "mlora_adapter_prefetch_precision_ratio",
                 "mlora_adapter_rank_padding_ratio", "mlora_completion_tokens_per_second"):
        assert math.isnan(prom[(name, frozenset())]), name


def test_prometheus_text_parses_back_to_the_snapshot(tmp_path):
    clock = Clock(100.0)
    m = scripted(clock)
    path = m.write_prometheus(str(tmp_path))
    assert path == os.path.join(str(tmp_path), PROM_NAME) and PROM_NAME == "_metrics.prom"
    assert sorted(os.listdir(tmp_path)) == [PROM_NAME]  # no temp file left behind
    text = (tmp_path / PROM_NAME).read_bytes()
    assert text == m.prometheus_text()
    prom = prom_samples(text)
    s = m.snapshot()

    def value(name, **labels):
        return prom[(name, frozenset(labels.items()))]

    assert value("mlora_adapter_load_amplification_ratio") == 2.5
    assert value("mlora_adapter_prefetch_precision_ratio") == 0.625
    assert value("mlora_adapter_rank_padding_ratio") == 1.375
    assert value("mlora_completion_tokens_per_second") == 5.0
    assert value("mlora_job_elapsed_seconds") == 4.0
    assert value("mlora_rows_finished_total", finish_reason="error") == 4
    assert value("mlora_row_errors_total", error_code="E_ALORA_NO_INVOCATION") == 1
    assert value("mlora_row_errors_total", error_code="other") == 1
    assert value("mlora_adapter_h2d_bytes_total") == 10000
    assert value("mlora_adapter_load_failures_total", tier="disk") == 1
    assert value("mlora_adapter_cache_misses_total", tier="device") == 1
    assert value("mlora_adapter_residency_state_count", state="idle") == 3
    assert value("mlora_adapter_residency_state_count", state="published") == 0
    assert value("mlora_iteration_tokens_total", phase="decode") == 8
    assert value("mlora_preemptions_total") == 2
    assert value("mlora_prefill_tokens_computed_total") == 20
    assert value("mlora_prefill_tokens_reused_total") == 32
    assert value("mlora_prefix_cache_lookup_blocks_total") == 8
    assert value("mlora_prefix_cache_hit_blocks_total") == 2
    assert value("mlora_prefix_cache_evictions_total") == 3
    assert value("mlora_prefix_cache_published_blocks_total") == 4
    assert value("mlora_prefix_cache_shared_blocks_peak") == 2
    assert value("mlora_alora_rows_without_invocation_total") == 1
    for le, n in s["histograms"]["adapter_distinct_per_iteration"]["buckets"].items():
        assert value("mlora_adapter_distinct_per_iteration_bucket", le=le) == n
    assert value("mlora_adapter_load_latency_seconds_count", tier="host") == 2
    assert not any(name.endswith("_created") for name, _ in prom)
    # the same events under the same clock write the same bytes
    assert scripted(Clock(100.0)).prometheus_text() == text


def test_snapshot_round_trips_through_json():
    m = scripted(Clock(100.0))
    m.adapter_load(10, math.nan, False, "host")  # a broken timer must not make the JSON unwritable
    s = m.snapshot()
    assert json.loads(json.dumps(s, allow_nan=False)) == s
    assert s["histograms"]["adapter_load_latency_seconds"]["host"]["sum"] is None


def test_unknown_error_codes_are_capped_into_other():
    m = JobMetrics(clock=Clock(0.0))
    for i in range(10_000):
        m.row_finished("error", f"E_NEW_{i}")
    for code in sorted(ERROR_CODES):
        m.row_finished("error", code)
    m.row_finished("error")  # an error row without a code
    s = m.snapshot()
    assert s["errors_by_code"]["other"] == 10_001
    assert len(s["errors_by_code"]) == len(ERROR_CODES) + 1
    codes = [dict(smp.labels)["error_code"] for fam in m.registry.collect() if fam.name == "mlora_row_errors"
             for smp in fam.samples]
    assert len(codes) == len(set(codes)) == len(ERROR_CODES) + 1
    assert {"E_PROMPT_NULL", "E_NON_FINITE", "U_DORA", "E_ADAPTER_LOAD"} <= set(codes)


def test_every_label_is_bounded_and_no_metric_names_an_adapter_or_row():
    m = scripted(Clock(100.0))
    for i in range(500):
        m.row_finished("error", f"adapter-{i}/E_BAD")  # an id smuggled into a code is still "other"
    families = list(m.registry.collect())
    assert len(families) >= 25
    for fam in families:
        assert fam.name.startswith("mlora_"), fam.name
        for smp in fam.samples:
            for label, val in smp.labels.items():
                if label == "le":
                    continue
                assert label in LABEL_VALUES, (fam.name, label)
                assert val in LABEL_VALUES[label], (fam.name, label, val)
    names = {label for fam in families for smp in fam.samples for label in smp.labels}
    assert not names & {"adapter", "adapter_id", "row", "row_id", "id", "path", "sha256", "digest"}
    # nothing leaks into the process-global registry
    assert not [f for f in prometheus_client.REGISTRY.collect() if f.name.startswith("mlora_")]
    assert m.registry is not prometheus_client.REGISTRY


def test_two_jobs_do_not_share_state():
    clock = Clock(100.0)
    a = scripted(clock)
    b = JobMetrics(clock=clock)
    fresh = JobMetrics(clock=clock)
    b.row_finished("stop", completion_tokens=1)
    assert a.snapshot()["rows_finished"] == 7 and b.snapshot()["rows_finished"] == 1
    assert fresh.snapshot()["rows_finished"] == 0 and fresh.snapshot()["h2d_bytes"] == 0
    assert a.registry is not b.registry
    assert a.prometheus_text() != b.prometheus_text()


@pytest.mark.parametrize("call", [
    lambda m: m.row_finished("eos"),
    lambda m: m.adapter_load(1, 0.1, True, "gpu"),
    lambda m: m.cache(True, "ssd"),
    lambda m: m.eviction("cpu"),
    lambda m: m.residency_states({"loaded": 1}),
])
def test_an_unknown_vocabulary_word_is_a_caller_bug(call):
    m = JobMetrics(clock=Clock(0.0))
    with pytest.raises(ValueError):
        call(m)
    assert m.snapshot() == JobMetrics(clock=Clock(0.0)).snapshot()


def test_docstring_lists_every_metric_and_snapshot_key():
    doc = metrics_mod.__doc__
    m = scripted(Clock(100.0))
    for fam in m.registry.collect():
        shown = fam.name + "_total" if fam.type == "counter" else fam.name
        assert shown in doc, shown
    s = m.snapshot()
    for key in list(s) + list(s["histograms"]):
        assert key in doc, key


def test_absorbing_two_engines_adds_engine_counters_but_not_rows_or_unique_bytes():
    """A job on two engines: the job counts its rows and each adapter's bytes once; the
    engines' counters and histograms add (load amplification is job-wide)."""
    clock = Clock(100.0)
    a, b = scripted(clock), scripted(clock)
    job = JobMetrics(clock=clock)
    job.row_finished("stop", prompt_tokens=10, completion_tokens=5)
    job.unique_adapter_bytes(4000)  # the same two adapters, used by both engines
    job.absorb(a.engine_state())
    job.absorb(b.engine_state())
    s, one = job.snapshot(), a.snapshot()
    assert s["rows_finished"] == 1 and s["completion_tokens"] == 5
    assert s["iterations"] == 2 * one["iterations"] and s["h2d_bytes"] == 2 * one["h2d_bytes"]
    assert s["unique_adapter_bytes"] == 4000 and s["load_amplification"] == 2 * one["load_amplification"]
    assert s["adapter_loads"] == {t: 2 * v for t, v in one["adapter_loads"].items()}
    assert s["residency_states"] == {k: 2 * v for k, v in one["residency_states"].items()}
    h, h1 = s["histograms"], one["histograms"]
    assert h["iteration_seconds"]["count"] == 2 * h1["iteration_seconds"]["count"]
    assert h["adapter_distinct_per_iteration"]["buckets"] == {
        k: 2 * v for k, v in h1["adapter_distinct_per_iteration"]["buckets"].items()}
    assert h["adapter_load_latency_seconds"]["disk"]["sum"] == 2 * h1["adapter_load_latency_seconds"]["disk"]["sum"]
    assert s["preemptions"] == 4 and s["prefetch_issued"] == 16
    assert s["prefill_tokens_reused"] == 2 * one["prefill_tokens_reused"] and s["alora_rows_without_invocation"] == 2
    assert s["prefix_cache"] == {"hit_rate": 0.25, "hit_blocks": 4, "looked_up_blocks": 16, "evictions": 6,
                                 "published_blocks": 8, "shared_blocks_peak": 2}  # the peak: max, not sum


def test_absorbing_two_engines_adds_prefix_counters_and_keeps_the_larger_shared_peak():
    """Each engine has its own prefix cache: its counters add into the job's, the job's
    shared-blocks peak is the larger engine peak (no block is shared across engines), and
    the hit rate is recomputed from the summed blocks."""
    clock = Clock(0.0)
    a, b = JobMetrics(clock=clock), JobMetrics(clock=clock)
    a.prefix_admission(reused=48, computed=16)
    a.prefix_cache(looked_up=4, hit=3, evicted=0, published=1, shared=3)
    a.prefix_cache(looked_up=0, hit=0, evicted=0, published=0, shared=1)
    b.prefix_admission(reused=0, computed=40)
    b.prefix_cache(looked_up=6, hit=0, evicted=2, published=5, shared=2)
    b.alora_without_invocation()
    b.alora_without_invocation()
    job = JobMetrics(clock=clock)
    job.prefix_cache(looked_up=0, hit=0, evicted=0, published=0, shared=0)
    job.absorb(a.engine_state())
    job.absorb(b.engine_state())
    s = job.snapshot()
    assert (s["prefill_tokens_computed"], s["prefill_tokens_reused"]) == (56, 48)
    assert s["prefix_cache"] == {"hit_rate": 0.3, "hit_blocks": 3, "looked_up_blocks": 10, "evictions": 2,
                                 "published_blocks": 6, "shared_blocks_peak": 3}
    assert s["alora_rows_without_invocation"] == 2
    prom = prom_samples(job.prometheus_text())
    assert prom[("mlora_prefix_cache_shared_blocks_peak", frozenset())] == 3
    assert prom[("mlora_prefill_tokens_reused_total", frozenset())] == 48
    assert prom[("mlora_alora_rows_without_invocation_total", frozenset())] == 2
    # the engine state is plain picklable values: what a worker process sends back
    assert pickle.loads(pickle.dumps(a.engine_state())) == a.engine_state()
