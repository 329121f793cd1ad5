"""Several engines, one job: what each engine reports and how the job merges the reports.

Owns the report of one engine (:class:`EngineReport`), its merge into the
job's metrics and summary (:func:`merge_reports`, the same for the
``--gpus`` / ``--num-workers`` coordinator and the Ray driver), and the form
a Ray actor's report travels in (:func:`encode_report`, :class:`LatestReports`).
Must not know how an engine runs or how a report reaches the job's process.

Decisions:

* A report is cumulative: everything the engine did since it started. The
  job absorbs each engine's last report once, so a Ray actor may report with
  every batch, and a report lost or seen twice changes nothing as long as a
  later one arrives (the Ray driver keeps the highest sequence number of each
  actor).
* Unique adapter bytes are counted once per adapter for the job, from the
  union of the adapters the engines used: ``load_amplification`` is job-wide
  (docs/scaleout.md, Metrics).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from mlora.batch.engine.engine import stored_adapter_bytes
from mlora.batch.job.metrics import JobMetrics


@dataclass
class EngineReport:
    """One engine's figures: ``state`` (its ``JobMetrics.engine_state()``), the adapters its rows
    used, its engine and bank stats (``EngineSession.stats()``), and the rows and generated
    tokens it ran (a Ray actor's own count; the coordinator counts its workers' rows itself)."""

    state: dict
    adapters_used: list
    engine: dict
    bank: dict
    rows: int = 0
    generated_tokens: int = 0


def session_report(session, rows: int) -> EngineReport:
    """The cumulative report of an :class:`~mlora.batch.job.session.EngineSession` that ran ``rows`` rows."""
    engine_stats, bank_stats = session.stats()
    return EngineReport(session.metrics.engine_state(), sorted(session.engine.adapters_used), engine_stats,
                        bank_stats, rows, session.engine.stats["generated_tokens"])


def merge_reports(metrics: JobMetrics, pinned: dict, reports: list[EngineReport]) -> tuple[dict, dict]:
    """Absorb every report into the job's ``metrics`` (``JobMetrics.absorb``: counters add),
    count each adapter any engine used once in unique adapter bytes, and return the engine
    and bank stats merged over the engines (:func:`merge_stats`; the summary's ``engine`` and
    ``bank``)."""
    for r in reports:
        metrics.absorb(r.state)
    for a in sorted(set().union(*(r.adapters_used for r in reports))):
        metrics.unique_adapter_bytes(stored_adapter_bytes(pinned[a]))
    return merge_stats([r.engine for r in reports]), merge_stats([r.bank for r in reports])


def merge_stats(dicts: list[dict]) -> dict:
    """Key-wise merge of the engines' stats (``EngineSession.stats()``): counters add; a peak or
    a maximum (``*_max_ms``, ``*peak*``) is the largest engine's; a per-load mean (``*_ms_mean``)
    is weighted by each engine's ``loads``; a per-load percentile (``*_ms_p50``, ``*_ms_p90``)
    is the slowest engine's (an upper bound on the job's); nested counters (``gc_collections``)
    merge the same way; lists (one entry per follower rank) are joined; anything else is the
    first engine's."""
    out: dict = {}
    for k in dict.fromkeys(k for d in dicts for k in d):
        have = [d for d in dicts if k in d]
        values = [d[k] for d in have]
        if all(_number(v) for v in values):
            if k.endswith("_max_ms") or "peak" in k or k.endswith(("_ms_p50", "_ms_p90")):
                out[k] = max(values)
            elif k.endswith("_ms_mean"):
                weights = [d.get("loads", 1) if _number(d.get("loads", 1)) else 1 for d in have]
                out[k] = round(sum(v * w for v, w in zip(values, weights)) / max(sum(weights), 1), 4)
            else:
                out[k] = sum(values)
        elif all(isinstance(v, dict) for v in values):
            out[k] = merge_stats(values)
        elif all(isinstance(v, list) for v in values):
            out[k] = [x for v in values for x in v]
        else:
            out[k] = values[0]
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def encode_report(actor: str, seq: int, report: EngineReport) -> str:
    """A Ray actor's report as JSON text: its id, the number of its report (1, 2, ...), the report."""
    return json.dumps({"actor": actor, "seq": seq, "report": asdict(report)})


class LatestReports:
    """The latest report of each actor, from the texts :func:`encode_report` made (in any order,
    some more than once); :meth:`reports` in the order the actors were first seen."""

    def __init__(self):
        self._latest: dict[str, tuple[int, EngineReport]] = {}

    def add(self, text: str) -> None:
        d = json.loads(text)
        seen = self._latest.get(d["actor"])
        if seen is None or d["seq"] > seen[0]:
            self._latest[d["actor"]] = (d["seq"], EngineReport(**d["report"]))

    def reports(self) -> list[EngineReport]:
        return [r for _, r in self._latest.values()]
