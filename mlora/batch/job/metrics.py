"""The metrics of one ``mlora batch-run`` job: counters in, figures out.

Owns the per-job metric state, its Prometheus view (a private
``prometheus_client.CollectorRegistry``, never the process-global one), the
derived figures and the two renderings the job writes into OUTPUT:
:meth:`JobMetrics.snapshot` (the JSON dict for ``_metrics.json``) and
:meth:`JobMetrics.write_prometheus` (``_metrics.prom``). Must not know the
engine, the residency engine or the output protocol: callers report events
with plain Python numbers; files go through ``output.atomic_write``.

Each method is the publication point of its metrics; call it when the
event has happened, not when it is planned::

    row_finished(finish_reason, error_code=None, prompt_tokens=0, completion_tokens=0)
        a row's result is final (handed to the output sink)
    iteration(prefill_tokens, decode_tokens, distinct_adapters, rank_rows_true, rank_rows_padded, seconds)
        one engine iteration completed
    adapter_load(bytes_h2d, seconds, ok, tier_from)
        one load attempt ended, published (ok) or rolled back (not ok)
    cache(hit, tier)             one residency lookup at ``tier`` found (or missed) a usable generation
    eviction(tier)               one adapter left ``tier``
    residency_states(counts)     the current count of adapters per residency state (states not named: 0)
    prefetch(issued, used)       host-tier prefetch builds started / prefetched images a load later used
    unique_adapter_bytes(n)      ``n`` more adapter bytes used for the first time in this job
    preemption()                 one sequence preempted (its KV freed, recomputed later)
    prefix_admission(reused, computed)
        a row's prompt tokens at its first admission: taken from the prefix cache / left to compute
    prefix_cache(looked_up, hit, evicted, published, shared)
        the prefix cache's block counters since the last call (blocks looked up, blocks found,
        evictions, publications) and ``shared``, the blocks more than one row holds now (the peak is kept)
    alora_without_invocation()   one aLoRA row without its invocation run on the base (``base`` policy)

Calls are cheap (integer adds under one lock, a bisect for histograms) and take
plain numbers. Vocabularies are fixed: an unknown ``finish_reason``, ``tier``,
``phase`` or residency state is a caller bug and raises ``ValueError``; an
unknown error code is a new code, counted as ``other``.

Label policy (bounded cardinality). Labels and their only values:

    finish_reason  stop | length | error
    error_code     one of :data:`ERROR_CODES` (row codes and every finding code), else "other"
    phase          prefill | decode
    state          :data:`RESIDENCY_STATES` (docs/design.md, Residency states)
    tier           disk | host | device

No metric carries an adapter id, alias, digest, path, row id or request id:
the number of series does not grow with the catalog or the input. Identity
belongs in the output rows and logs, not in labels.

Prometheus metrics (units in the name; counters end in ``_total``)::

    mlora_rows_finished_total{finish_reason}           rows whose result is final
    mlora_row_errors_total{error_code}                 error rows per code
    mlora_prompt_tokens_total                          prompt tokens of finished rows
    mlora_completion_tokens_total                      generated tokens of finished rows
    mlora_job_elapsed_seconds                          gauge: clock time since the metrics started
    mlora_completion_tokens_per_second                 gauge: completion tokens / elapsed seconds
    mlora_iterations_total                             engine iterations completed
    mlora_iteration_tokens_total{phase}                tokens (plan rows) run, per phase
    mlora_iteration_seconds                            histogram: wall time of one iteration
    mlora_adapter_distinct_per_iteration               histogram: distinct adapters in one iteration
    mlora_adapter_true_rank_row_values_total           sum over rows of the adapter's logical rank
    mlora_adapter_padded_rank_row_values_total         sum over rows of the rank the kernel ran at
    mlora_adapter_rank_padding_ratio                   gauge: padded / true rank row values
    mlora_adapter_load_requests_total{tier}            load attempts, by source tier (failed ones too)
    mlora_adapter_load_failures_total{tier}            load attempts that did not publish
    mlora_adapter_load_latency_seconds{tier}           histogram: attempt start to publish or rollback
    mlora_adapter_h2d_bytes_total                      bytes copied host -> device by load attempts
    mlora_adapter_unique_bytes_total                   bytes of the distinct adapters rows used
    mlora_adapter_load_amplification_ratio             gauge: h2d bytes / unique bytes
    mlora_adapter_cache_hits_total{tier}               lookups that found a usable generation
    mlora_adapter_cache_misses_total{tier}             lookups that did not (cold or stale)
    mlora_adapter_evictions_total{tier}                adapters removed from a tier
    mlora_adapter_residency_state_count{state}         gauge: adapters per residency state
    mlora_adapter_prefetch_issued_total                host-tier prefetch builds started
    mlora_adapter_prefetch_used_total                  of those, images a load later used
    mlora_adapter_prefetch_precision_ratio             gauge: used / issued
    mlora_preemptions_total                            sequences preempted for KV space
    mlora_prefill_tokens_computed_total                prompt tokens admitted rows left to compute
    mlora_prefill_tokens_reused_total                  prompt tokens admitted rows took from the prefix cache
    mlora_prefix_cache_lookup_blocks_total             KV blocks looked up in the prefix cache
    mlora_prefix_cache_hit_blocks_total                of those, blocks found
    mlora_prefix_cache_evictions_total                 cached blocks evicted (unreferenced, oldest first)
    mlora_prefix_cache_published_blocks_total          full blocks published into the prefix cache
    mlora_prefix_cache_shared_blocks_peak              gauge: most blocks held by more than one row at once
    mlora_alora_rows_without_invocation_total          aLoRA rows without their invocation, run on the base

Formulas (denominators over the whole job; a ratio with a zero denominator is
undefined: ``null`` in JSON, ``NaN`` in the Prometheus file)::

    tokens_per_s           = completion_tokens / elapsed_s
    iteration_tokens_per_s = (prefill_tokens + decode_tokens) / iteration_seconds
    rank_padding_ratio     = sum(rank_rows_padded) / sum(rank_rows_true)
    load_amplification     = h2d_bytes / unique_adapter_bytes        (failed and prefetch copies count)
    prefetch_precision     = prefetch_used / prefetch_issued
    cache_hit_rate[tier]   = cache_hits[tier] / (cache_hits[tier] + cache_misses[tier])
    prefix_cache.hit_rate  = prefix_cache.hit_blocks / prefix_cache.looked_up_blocks

``snapshot()`` keys (stable; ``schema_version`` changes if one changes meaning)::

    schema_version, elapsed_s,
    rows_finished, finish_reasons{stop,length,error}, errors_by_code{code: n},
    prompt_tokens, completion_tokens, tokens_per_s,
    iterations, iteration_seconds, prefill_tokens, decode_tokens, iteration_tokens_per_s,
    rank_true_row_values, rank_padded_row_values, rank_padding_ratio,
    adapter_loads{tier}, adapter_load_failures{tier}, h2d_bytes, unique_adapter_bytes, load_amplification,
    cache_hits{tier}, cache_misses{tier}, cache_hit_rate{tier}, evictions{tier}, residency_states{state},
    prefetch_issued, prefetch_used, prefetch_precision, preemptions,
    prefill_tokens_computed, prefill_tokens_reused (their sum: the prompt tokens of the rows admitted),
    prefix_cache{hit_rate, hit_blocks, looked_up_blocks, evictions, published_blocks, shared_blocks_peak},
    alora_rows_without_invocation,
    histograms{iteration_seconds, adapter_distinct_per_iteration, adapter_load_latency_seconds{tier}}

A histogram is ``{"buckets": {le: cumulative count}, "count": n, "sum": s}``
with the same ``le`` strings as the Prometheus file (``"+Inf"`` last).

Decisions:

* The state lives in plain Python numbers; the registry holds one custom
  collector that renders it on collection. One source of truth for the JSON
  and the Prometheus file, integers stay integers in JSON, and the hot path
  never touches ``prometheus_client``.
* No ``*_created`` series: the file describes one job, and the same events
  with the same clock give byte-identical text.
* ``adapter_load`` counts H2D bytes of failed attempts too: load amplification
  measures the copies the job paid for, failed attempts included (docs/design.md,
  Load amplification).
"""

from __future__ import annotations

import bisect
import math
import os
import threading
import time
from typing import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from mlora.batch.job.output import atomic_write
from mlora.lora_tools.findings import CODES

PROM_NAME = "_metrics.prom"  # leading underscore: Parquet readers of OUTPUT skip it
SCHEMA_VERSION = 1

FINISH_REASONS = ("stop", "length", "error")
PHASES = ("prefill", "decode")
PREFIX_COUNTERS = ("looked_up_blocks", "hit_blocks", "evictions", "published_blocks")
TIERS = ("disk", "host", "device")
RESIDENCY_STATES = ("absent", "host_ready", "reserved", "loading", "validated", "published", "active", "idle",
                    "retiring")
OTHER_CODE = "other"
# Codes a row can end with: the job's and the engine's row codes, the residency
# engine's, and every adapter finding code (a bad adapter's rows carry its code).
ROW_ERROR_CODES = (
    "E_PROMPT_NULL", "E_PROMPT_EMPTY", "E_PROMPT_TOO_LONG", "E_PROMPT_TOKEN_RANGE", "E_MAX_NEW_TOKENS",
    "E_PROMPT_MESSAGES", "E_PROMPT_TEMPLATE",
    "E_ADAPTER_UNKNOWN", "E_ADAPTER_INVALID", "E_ADAPTER_CHANGED", "E_ADAPTER_DIGEST_MISMATCH",
    "E_ADAPTER_MODULE_UNSUPPORTED", "E_ADAPTER_LOAD", "E_BANK_RANK_EXCEEDS_R", "E_BANK_SHAPE", "E_ENGINE_STUCK",
    "E_ALORA_NO_INVOCATION",
)
ERROR_CODES = frozenset(ROW_ERROR_CODES) | frozenset(CODES)
LABEL_VALUES: dict[str, frozenset[str]] = {  # every label this module emits, with every value it may take
    "finish_reason": frozenset(FINISH_REASONS),
    "error_code": ERROR_CODES | {OTHER_CODE},
    "phase": frozenset(PHASES),
    "state": frozenset(RESIDENCY_STATES),
    "tier": frozenset(TIERS),
}

ITERATION_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DISTINCT_ADAPTER_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# a rank-16 q/v adapter of an 8B model is ~14 MB: ~0.3 ms at H2D bandwidth
LOAD_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                        2.5, 5.0, 10.0)


def _le(bound: float) -> str:
    return "+Inf" if bound == math.inf else repr(float(bound))


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _finite_or_none(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    return value


def _check(kind: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{kind} must be one of {', '.join(allowed)}, not {value!r}")


class _Histogram:
    """Fixed buckets, ``le`` semantics (an observation equal to a bound counts in that bucket)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(bounds) + 1)  # last: above every bound (+Inf)
        self.sum = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip(self.bounds + (math.inf,), self.counts):
            running += n
            out.append((_le(bound), running))
        return out

    def to_json(self) -> dict:
        buckets = self.cumulative()
        return {"buckets": dict(buckets), "count": buckets[-1][1], "sum": self.sum}


class JobMetrics:
    """The metric state of one job; see the module docstring for names and formulas.

    ``clock`` (seconds, monotonic) is read once now and again by every
    snapshot or collection: ``elapsed_s`` is the difference.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._t0 = clock()
        self._lock = threading.Lock()
        self.finish_reasons = dict.fromkeys(FINISH_REASONS, 0)
        self.errors_by_code: dict[str, int] = {}
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.iterations = 0
        self.iteration_seconds = 0
        self.phase_tokens = dict.fromkeys(PHASES, 0)
        self.rank_true = 0
        self.rank_padded = 0
        self.loads = dict.fromkeys(TIERS, 0)
        self.load_failures = dict.fromkeys(TIERS, 0)
        self.h2d_bytes = 0
        self.unique_bytes = 0
        self.cache_hits = dict.fromkeys(TIERS, 0)
        self.cache_misses = dict.fromkeys(TIERS, 0)
        self.evictions = dict.fromkeys(TIERS, 0)
        self.states = dict.fromkeys(RESIDENCY_STATES, 0)
        self.prefetch_issued = 0
        self.prefetch_used = 0
        self.preemptions = 0
        self.prefill_computed = 0
        self.prefill_reused = 0
        self.prefix = dict.fromkeys(PREFIX_COUNTERS, 0)
        self.prefix_shared_peak = 0
        self.alora_base_rows = 0
        self.hist_iteration = _Histogram(ITERATION_SECONDS_BUCKETS)
        self.hist_distinct = _Histogram(DISTINCT_ADAPTER_BUCKETS)
        self.hist_load = {t: _Histogram(LOAD_SECONDS_BUCKETS) for t in TIERS}
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))

    # -- events ------------------------------------------------------------

    def row_finished(self, finish_reason: str, error_code: str | None = None, prompt_tokens: int = 0,
                     completion_tokens: int = 0) -> None:
        _check("finish_reason", finish_reason, FINISH_REASONS)
        code = None
        if error_code is not None or finish_reason == "error":
            code = error_code if error_code in ERROR_CODES else OTHER_CODE
        with self._lock:
            self.finish_reasons[finish_reason] += 1
            if code is not None:
                self.errors_by_code[code] = self.errors_by_code.get(code, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens

    def iteration(self, prefill_tokens: int, decode_tokens: int, distinct_adapters: int, rank_rows_true: int,
                  rank_rows_padded: int, seconds: float) -> None:
        with self._lock:
            self.iterations += 1
            self.iteration_seconds += seconds
            self.phase_tokens["prefill"] += prefill_tokens
            self.phase_tokens["decode"] += decode_tokens
            self.rank_true += rank_rows_true
            self.rank_padded += rank_rows_padded
            self.hist_iteration.observe(seconds)
            self.hist_distinct.observe(distinct_adapters)

    def adapter_load(self, bytes_h2d: int, seconds: float, ok: bool, tier_from: str) -> None:
        _check("tier_from", tier_from, TIERS)
        with self._lock:
            self.loads[tier_from] += 1
            if not ok:
                self.load_failures[tier_from] += 1
            self.h2d_bytes += bytes_h2d
            self.hist_load[tier_from].observe(seconds)

    def cache(self, hit: bool, tier: str) -> None:
        _check("tier", tier, TIERS)
        with self._lock:
            (self.cache_hits if hit else self.cache_misses)[tier] += 1

    def eviction(self, tier: str) -> None:
        _check("tier", tier, TIERS)
        with self._lock:
            self.evictions[tier] += 1

    def residency_states(self, counts: dict[str, int]) -> None:
        for state in counts:
            _check("residency state", state, RESIDENCY_STATES)
        with self._lock:
            for state in RESIDENCY_STATES:
                self.states[state] = counts.get(state, 0)

    def prefetch(self, issued: int, used: int) -> None:
        with self._lock:
            self.prefetch_issued += issued
            self.prefetch_used += used

    def unique_adapter_bytes(self, n: int) -> None:
        with self._lock:
            self.unique_bytes += n

    def preemption(self) -> None:
        with self._lock:
            self.preemptions += 1

    def prefix_admission(self, reused: int, computed: int) -> None:
        with self._lock:
            self.prefill_reused += reused
            self.prefill_computed += computed

    def prefix_cache(self, looked_up: int, hit: int, evicted: int, published: int, shared: int) -> None:
        with self._lock:
            for key, n in zip(PREFIX_COUNTERS, (looked_up, hit, evicted, published)):
                self.prefix[key] += n
            self.prefix_shared_peak = max(self.prefix_shared_peak, shared)

    def alora_without_invocation(self) -> None:
        with self._lock:
            self.alora_base_rows += 1

    # -- several engines, one job --------------------------------------------

    def engine_state(self) -> dict:
        """This engine's counters as plain, picklable values, for :meth:`absorb` in the job's
        process: iterations, tokens per phase, rank rows, loads, H2D bytes, cache, evictions,
        residency states, prefetch, preemptions, prefix cache and prefill reuse, aLoRA rows run on
        the base, and the histograms. Row counters and unique
        adapter bytes are left out (see :meth:`absorb`)."""
        with self._lock:
            return {
                "iterations": self.iterations, "iteration_seconds": self.iteration_seconds,
                "phase_tokens": dict(self.phase_tokens), "rank_true": self.rank_true,
                "rank_padded": self.rank_padded, "loads": dict(self.loads),
                "load_failures": dict(self.load_failures), "h2d_bytes": self.h2d_bytes,
                "cache_hits": dict(self.cache_hits), "cache_misses": dict(self.cache_misses),
                "evictions": dict(self.evictions), "states": dict(self.states),
                "prefetch_issued": self.prefetch_issued, "prefetch_used": self.prefetch_used,
                "preemptions": self.preemptions,
                "prefill_computed": self.prefill_computed, "prefill_reused": self.prefill_reused,
                "prefix": dict(self.prefix), "prefix_shared_peak": self.prefix_shared_peak,
                "alora_base_rows": self.alora_base_rows,
                "hist_iteration": (list(self.hist_iteration.counts), self.hist_iteration.sum),
                "hist_distinct": (list(self.hist_distinct.counts), self.hist_distinct.sum),
                "hist_load": {t: (list(h.counts), h.sum) for t, h in self.hist_load.items()},
            }

    def absorb(self, state: dict) -> None:
        """Add one engine's :meth:`engine_state` to this (the job's) metrics: counters and
        histogram buckets add, residency state counts add (adapters per state over all
        engines), the shared-blocks peak is the largest engine's (each engine has its own
        cache, so no block is shared across engines). Rows are counted by the job where it writes them (``row_finished``) and
        unique adapter bytes once per adapter for the whole job (``unique_adapter_bytes``),
        so load amplification is job-wide: an adapter loaded by two engines counts twice
        in ``h2d_bytes`` and once in the denominator. ``iteration_seconds`` sums engine
        time, so ``iteration_tokens_per_s`` is a per-engine rate."""
        def add(mine: dict, theirs: dict) -> None:
            for k, v in theirs.items():
                mine[k] += v

        def add_hist(h: _Histogram, counts_sum) -> None:
            counts, total = counts_sum
            h.counts = [a + b for a, b in zip(h.counts, counts)]
            h.sum += total

        with self._lock:
            self.iterations += state["iterations"]
            self.iteration_seconds += state["iteration_seconds"]
            add(self.phase_tokens, state["phase_tokens"])
            self.rank_true += state["rank_true"]
            self.rank_padded += state["rank_padded"]
            add(self.loads, state["loads"])
            add(self.load_failures, state["load_failures"])
            self.h2d_bytes += state["h2d_bytes"]
            add(self.cache_hits, state["cache_hits"])
            add(self.cache_misses, state["cache_misses"])
            add(self.evictions, state["evictions"])
            add(self.states, state["states"])
            self.prefetch_issued += state["prefetch_issued"]
            self.prefetch_used += state["prefetch_used"]
            self.preemptions += state["preemptions"]
            self.prefill_computed += state["prefill_computed"]
            self.prefill_reused += state["prefill_reused"]
            add(self.prefix, state["prefix"])
            self.prefix_shared_peak = max(self.prefix_shared_peak, state["prefix_shared_peak"])
            self.alora_base_rows += state["alora_base_rows"]
            add_hist(self.hist_iteration, state["hist_iteration"])
            add_hist(self.hist_distinct, state["hist_distinct"])
            for t, cs in state["hist_load"].items():
                add_hist(self.hist_load[t], cs)

    # -- figures -----------------------------------------------------------

    def snapshot(self) -> dict:
        """The JSON-able figures of the job so far (keys: module docstring)."""
        elapsed = self._clock() - self._t0
        with self._lock:
            tokens = self.phase_tokens["prefill"] + self.phase_tokens["decode"]
            snap = {
                "schema_version": SCHEMA_VERSION,
                "elapsed_s": elapsed,
                "rows_finished": sum(self.finish_reasons.values()),
                "finish_reasons": dict(self.finish_reasons),
                "errors_by_code": dict(sorted(self.errors_by_code.items())),
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "tokens_per_s": _ratio(self.completion_tokens, elapsed),
                "iterations": self.iterations,
                "iteration_seconds": self.iteration_seconds,
                "prefill_tokens": self.phase_tokens["prefill"],
                "decode_tokens": self.phase_tokens["decode"],
                "iteration_tokens_per_s": _ratio(tokens, self.iteration_seconds),
                "rank_true_row_values": self.rank_true,
                "rank_padded_row_values": self.rank_padded,
                "rank_padding_ratio": _ratio(self.rank_padded, self.rank_true),
                "adapter_loads": dict(self.loads),
                "adapter_load_failures": dict(self.load_failures),
                "h2d_bytes": self.h2d_bytes,
                "unique_adapter_bytes": self.unique_bytes,
                "load_amplification": _ratio(self.h2d_bytes, self.unique_bytes),
                "cache_hits": dict(self.cache_hits),
                "cache_misses": dict(self.cache_misses),
                "cache_hit_rate": {t: _ratio(self.cache_hits[t], self.cache_hits[t] + self.cache_misses[t])
                                   for t in TIERS},
                "evictions": dict(self.evictions),
                "residency_states": dict(self.states),
                "prefetch_issued": self.prefetch_issued,
                "prefetch_used": self.prefetch_used,
                "prefetch_precision": _ratio(self.prefetch_used, self.prefetch_issued),
                "preemptions": self.preemptions,
                "prefill_tokens_computed": self.prefill_computed,
                "prefill_tokens_reused": self.prefill_reused,
                "prefix_cache": {"hit_rate": _ratio(self.prefix["hit_blocks"], self.prefix["looked_up_blocks"]),
                                 **self.prefix, "shared_blocks_peak": self.prefix_shared_peak},
                "alora_rows_without_invocation": self.alora_base_rows,
                "histograms": {
                    "iteration_seconds": self.hist_iteration.to_json(),
                    "adapter_distinct_per_iteration": self.hist_distinct.to_json(),
                    "adapter_load_latency_seconds": {t: h.to_json() for t, h in self.hist_load.items()},
                },
            }
        return _finite_or_none(snap)

    def prometheus_text(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        return generate_latest(self.registry)

    def write_prometheus(self, out_dir: str) -> str:
        """Write :meth:`prometheus_text` atomically as ``out_dir/_metrics.prom``; return its path."""
        atomic_write(out_dir, PROM_NAME, self.prometheus_text())
        return os.path.join(out_dir, PROM_NAME)


class _Collector:
    """Renders a :class:`JobMetrics` snapshot as metric families on every collection."""

    def __init__(self, metrics: JobMetrics):
        self._m = metrics

    def describe(self):  # lets the registry see the names at register time (duplicate check)
        return self.collect()

    def collect(self):
        s = self._m.snapshot()
        nan = math.nan

        def counter(name, doc, value=None, label=None, values=None):
            fam = CounterMetricFamily(name, doc, labels=[label] if label else None)
            if label:
                for key, v in values.items():
                    fam.add_metric([key], v)
            else:
                fam.add_metric([], value)
            return fam

        def gauge(name, doc, value=None, label=None, values=None):
            fam = GaugeMetricFamily(name, doc, labels=[label] if label else None)
            if label:
                for key, v in values.items():
                    fam.add_metric([key], v)
            else:
                fam.add_metric([], nan if value is None else value)
            return fam

        def histogram(name, doc, hist, label=None, by=None):
            fam = HistogramMetricFamily(name, doc, labels=[label] if label else None)
            for key, h in (by.items() if label else [(None, hist)]):
                total = nan if h["sum"] is None else h["sum"]
                fam.add_metric([key] if label else [], list(h["buckets"].items()), total)
            return fam

        h = s["histograms"]
        yield counter("mlora_rows_finished_total", "Rows whose result is final.",
                      label="finish_reason", values=s["finish_reasons"])
        yield counter("mlora_row_errors_total", "Error rows per error code (unknown codes: other).",
                      label="error_code", values=s["errors_by_code"])
        yield counter("mlora_prompt_tokens_total", "Prompt tokens of finished rows.", s["prompt_tokens"])
        yield counter("mlora_completion_tokens_total", "Generated tokens of finished rows.",
                      s["completion_tokens"])
        yield gauge("mlora_job_elapsed_seconds", "Seconds since the job's metrics started.", s["elapsed_s"])
        yield gauge("mlora_completion_tokens_per_second", "Completion tokens per elapsed second.",
                    s["tokens_per_s"])
        yield counter("mlora_iterations_total", "Engine iterations completed.", s["iterations"])
        yield counter("mlora_iteration_tokens_total", "Tokens (plan rows) run, per phase.", label="phase",
                      values={"prefill": s["prefill_tokens"], "decode": s["decode_tokens"]})
        yield histogram("mlora_iteration_seconds", "Wall seconds of one engine iteration.",
                        h["iteration_seconds"])
        yield histogram("mlora_adapter_distinct_per_iteration", "Distinct adapters in one iteration.",
                        h["adapter_distinct_per_iteration"])
        yield counter("mlora_adapter_true_rank_row_values_total", "Sum over rows of the adapter's logical rank.",
                      s["rank_true_row_values"])
        yield counter("mlora_adapter_padded_rank_row_values_total",
                      "Sum over rows of the rank the kernel ran at.", s["rank_padded_row_values"])
        yield gauge("mlora_adapter_rank_padding_ratio", "Padded / true rank row values (whole job).",
                    s["rank_padding_ratio"])
        yield counter("mlora_adapter_load_requests_total", "Adapter load attempts, by source tier.",
                      label="tier", values=s["adapter_loads"])
        yield counter("mlora_adapter_load_failures_total", "Adapter load attempts that did not publish.",
                      label="tier", values=s["adapter_load_failures"])
        yield histogram("mlora_adapter_load_latency_seconds", "Seconds from load start to publish or rollback.",
                        None, label="tier", by=h["adapter_load_latency_seconds"])
        yield counter("mlora_adapter_h2d_bytes_total", "Bytes copied host to device by adapter loads.",
                      s["h2d_bytes"])
        yield counter("mlora_adapter_unique_bytes_total", "Bytes of the distinct adapters rows used.",
                      s["unique_adapter_bytes"])
        yield gauge("mlora_adapter_load_amplification_ratio", "H2D adapter bytes / unique adapter bytes used.",
                    s["load_amplification"])
        yield counter("mlora_adapter_cache_hits_total", "Residency lookups that found a usable generation.",
                      label="tier", values=s["cache_hits"])
        yield counter("mlora_adapter_cache_misses_total", "Residency lookups that found none (cold or stale).",
                      label="tier", values=s["cache_misses"])
        yield counter("mlora_adapter_evictions_total", "Adapters removed from a tier.", label="tier",
                      values=s["evictions"])
        yield gauge("mlora_adapter_residency_state_count", "Adapters per residency state.",
                    label="state", values=s["residency_states"])
        yield counter("mlora_adapter_prefetch_issued_total", "Host-tier adapter prefetch builds started.",
                      s["prefetch_issued"])
        yield counter("mlora_adapter_prefetch_used_total", "Prefetched adapter images a load later used.",
                      s["prefetch_used"])
        yield gauge("mlora_adapter_prefetch_precision_ratio", "Prefetches used / prefetches issued.",
                    s["prefetch_precision"])
        yield counter("mlora_preemptions_total", "Sequences preempted for KV space.", s["preemptions"])
        p = s["prefix_cache"]
        yield counter("mlora_prefill_tokens_computed_total", "Prompt tokens admitted rows left to compute.",
                      s["prefill_tokens_computed"])
        yield counter("mlora_prefill_tokens_reused_total", "Prompt tokens admitted rows took from the prefix cache.",
                      s["prefill_tokens_reused"])
        yield counter("mlora_prefix_cache_lookup_blocks_total", "KV blocks looked up in the prefix cache.",
                      p["looked_up_blocks"])
        yield counter("mlora_prefix_cache_hit_blocks_total", "KV blocks the prefix cache had.", p["hit_blocks"])
        yield counter("mlora_prefix_cache_evictions_total", "Cached KV blocks evicted from the prefix cache.",
                      p["evictions"])
        yield counter("mlora_prefix_cache_published_blocks_total", "Full KV blocks published into the prefix cache.",
                      p["published_blocks"])
        yield gauge("mlora_prefix_cache_shared_blocks_peak", "Most KV blocks held by more than one row at once.",
                    p["shared_blocks_peak"])
        yield counter("mlora_alora_rows_without_invocation_total",
                      "aLoRA rows whose prompt lacks the invocation, run on the base.",
                      s["alora_rows_without_invocation"])
