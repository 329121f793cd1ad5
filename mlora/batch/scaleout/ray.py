"""mlora on Ray Data: ``mlora batch-run --engine ray`` and the public actor class :class:`MloraPredictor`.

Owns the Ray side of a job: the stateful actor class (one mlora engine per
actor, usable in anyone's Ray Data pipeline), the read step (row ranges of
the input with their positions, sorted by adapter), and the driver that runs
the pipeline and writes mlora's output layout. Must not know how an engine
runs a row (``session.py``) or how OUTPUT is committed (``job.RowWriter`` and
``output.py``). Ray Data is the optional extra ``mlora[ray]``: this module
imports it, and is itself imported only for ``--engine ray``; without Ray,
importing it raises ``E_RAY_MISSING`` (exit 1) naming the extra.

The pipeline of ``run_ray_job``::

    ray.data.from_items(windows)         one item per window of rows, from the resume point on
      .map_batches(read_window)          a Ray task reads its rows with mlora's own reader (same checks,
                                         row positions, ids), sorts them by adapter (then input order)
                                         and yields them in blocks of ``batch_rows``: adapter-coherent batches
      .map_batches(MloraPredictor, batch_size=batch_rows, compute=ActorPoolStrategy(size=N), num_gpus=TP | 0)
      .iter_batches()                    on the driver: each row to the job's RowWriter by its position,
                                         each actor's latest engine report kept (engines.LatestReports)

Decisions:

* Rows are read by Ray tasks (``read_window``), not by ``ray.data.read_parquet``:
  mlora's resume contract numbers rows by their position in the input, which
  Ray's Parquet reader does not expose. The reader refuses an input whose
  fingerprint differs from the one the driver pinned (``E_INPUT_CHANGED``).
  On a cluster, INPUT must be on a file system every node mounts; OUTPUT is
  written by the driver only.
* One batch is one engine scheduling window (``batch_rows = --schedule-window``,
  default 8192 rows): an actor runs each batch to completion. A window is
  ``num_workers`` batches, sorted by adapter as a whole, so each batch holds
  few adapters. Ray, not mlora, decides which actor gets which batch: an
  adapter is loaded at most once per actor while it stays in the actor's
  slots, so load amplification is at most the number of actors (the
  ``--gpus`` coordinator keeps adapters on one worker; Ray does not).
* Output: exactly the single-process layout and bytes. The driver hands every
  finished row to the ResultSink by input position, so shards follow input
  order, ``_manifest.json`` and ``_SUCCESS`` are mlora's, and a job may be
  resumed with another engine (the fingerprint does not name the engine).
  The driver holds finished rows until the rows before them finish: about
  the windows Ray runs at once.
* Metrics: the actors run with ``engine_report=True``: each batch's last row
  carries the actor's cumulative engine report in a column the driver reads
  and never writes. The driver merges each actor's latest report once at the
  end (``engines.merge_reports``, as the coordinator merges its workers), so a
  report lost or handed over twice does not change the job's figures.
* Resume: an interrupted Ray job (Ctrl-C, a failed actor, a lost driver)
  keeps its committed shards; ``--resume`` starts the pipeline at the first
  uncommitted row. A failure inside Ray stops the job with the error's own
  code where it has one (an input or model error: exit 1), else
  ``E_RAY_FAILED`` (exit 3, rerun with ``--resume``).
* Device: ``--device auto`` runs on GPUs when the cluster has any (one GPU per
  actor, ``--num-workers`` default: every GPU of the cluster), else on CPUs
  (default one actor; each CPU actor reserves ``cpus // num_workers`` cores).
  ``--device cuda`` on a cluster without GPUs is ``E_DEVICE``.
* ``--tensor-parallel-size TP``: an actor is one replica, rank 0 of its own
  group (it starts the TP - 1 follower processes itself, as one process does).
  On GPUs it asks Ray for TP GPUs of one node, which Ray lists in the actor's
  ``CUDA_VISIBLE_DEVICES`` (rank j on its ``cuda:j``; the followers inherit
  it); on the CPU its cores are divided among its ranks
  (``placement.ray_actors``).
"""

from __future__ import annotations

import atexit
import os
import uuid
import weakref
from dataclasses import fields

import pyarrow as pa
import pyarrow.compute as pc
import torch

from mlora.batch.adapters.catalog import load_catalog
from mlora.batch.config import JobConfig, resolve_device, resolve_dtype
from mlora.batch.errors import JobError
from mlora.batch.job.input import InputBatch, JobInputError, open_input
from mlora.batch.job.metrics import JobMetrics
from mlora.batch.job.output import OUTPUT_COLUMNS, RESULT_FIELDS
from mlora.batch.job.prepare import NO_TOKENIZER_NOTE, RowWriter, finish_job, input_spec, prepare_job
from mlora.batch.job.session import EngineSession, requests_of
from mlora.batch.model.decoder import load_config
from mlora.batch.scaleout.engines import LatestReports, encode_report, merge_reports, session_report
from mlora.batch.scaleout.placement import RayActors, ray_actors

INSTALL_HINT = "pip install 'mlora[ray]'"
try:  # the optional extra mlora[ray]: without it, a coded error that names the extra
    import ray
    import ray.data
except ImportError as exc:
    raise JobError("E_RAY_MISSING", f"--engine ray needs Ray Data, which is not installed ({exc}); "
                   f"install it with: {INSTALL_HINT}") from None

# the role columns of the table read_window yields (kept input columns keep their names)
ROW, ID, PROMPT, PROMPT_IDS, ADAPTER, MAX_NEW = "_row", "_id", "_prompt", "_prompt_ids", "_adapter", "_max_new_tokens"
MESSAGES = "_messages"
ENGINE_REPORT = "_engine_report"  # MloraPredictor(engine_report=True): the actor's engine figures
# JobConfig fields a predictor takes as keyword options (the rest are about files and the job)
PREDICTOR_OPTIONS = frozenset(f.name for f in fields(JobConfig)) - {
    "input", "output", "base", "adapters_dir", "catalog_file", "keep_columns", "strict", "resume", "shard_rows",
    "commit_interval", "allow_duplicate_ids", "workers", "gpus", "num_workers", "engine", "ray_address"}


def pin_adapters(base: str, adapters: str | None = None, catalog: str | None = None,
                 ids: list[str] | None = None, workers: int | None = None, allow_pickle: bool = False) -> dict:
    """Validate and pin adapters once (every id of the catalog, or ``ids``) for
    ``MloraPredictor(pinned=...)``: actors then serve exactly these identities and
    do not hash the base and the adapters again each. Bad adapters are kept
    (their rows become error rows); ``allow_pickle`` as batch-run's ``--allow-pickle``."""
    catalog_ = load_catalog(adapters, catalog)
    return catalog_.pin(set(ids if ids is not None else catalog_.ids()), base, workers=workers,
                        allow_pickle=allow_pickle)


class MloraPredictor:
    """A Ray Data actor class holding one mlora engine (model, adapter slots, KV cache).

    Use it in your own pipeline::

        ds.map_batches(MloraPredictor, fn_constructor_kwargs=dict(base=..., adapters=..., max_new_tokens=64),
                       batch_size=2048, concurrency=2, num_gpus=1)

    With ``tensor_parallel_size=N`` each actor is rank 0 of N ranks and starts the other N - 1
    processes itself: pass ``num_gpus=N`` to ``map_batches`` so Ray gives it N GPUs of one node
    (on the CPU, ``torch_threads`` is each rank's share of the actor's cores). ``close()`` stops
    them (the actor's end does too).

    Constructor: ``base`` (checkpoint directory), ``adapters`` (a directory of
    adapters or a bundle) or ``catalog`` (a catalog file), or ``pinned`` (from
    :func:`pin_adapters`, recommended: pinned once on the driver; otherwise each
    actor pins ``adapter_ids``, default every adapter of the catalog); ``device``
    (auto | cuda | cpu), ``dtype``, ``torch_threads`` (CPU actors: per rank), ``keep_columns``, and any of
    :data:`PREDICTOR_OPTIONS` as keywords with batch-run's meaning and defaults
    (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``,
    ``max_num_seqs``, ``max_batch_tokens``, ``max_gpu_adapters``, ``host_cache_gb``, ``tensor_parallel_size``,
    ``kv_cache_gb``, ``id_column``, ``prompt_column`` or ``prompt_ids_column`` or ``messages_column``,
    ``adapter_column``, ``max_new_tokens_column``, ...).

    ``__call__(batch)``: a pandas DataFrame, a pyarrow Table or a dict of columns
    with the id, prompt (or prompt ids) and adapter columns (null, empty or
    ``__base__``: the base model). Returns the batch's ``keep_columns``
    unchanged (default: every column but the id and adapter columns), then
    ``id`` (in the id column's type) and mlora's output columns (``adapter``,
    ``adapter_sha256``, ``completion``, ``completion_token_ids``,
    ``finish_reason``, ``num_prompt_tokens``, ``num_completion_tokens``,
    ``error_code``, ``error_message``), one row per input row in the same
    order; a pandas batch gives a DataFrame, anything else a pyarrow Table. A
    row's output does not depend on its batch (greedy or seeded sampling, as in
    batch-run). An adapter that was not pinned gives ``E_ADAPTER_UNKNOWN`` rows.

    ``engine_report=True`` (default False; ``batch-run --engine ray`` turns it on) adds one
    string column, ``_engine_report``, last: null but on the batch's last row, which holds
    JSON of the actor's engine figures since it started (``scaleout.engines.encode_report``:
    a random actor id, the report's number, the engine's metrics, the adapters it used, its
    engine and bank stats, its rows). Keep each actor's highest-numbered report and merge
    them with ``scaleout.engines.LatestReports`` and ``merge_reports``: a later report
    contains every earlier one. Without it the output columns are as above.
    """

    def __init__(self, base: str, adapters: str | None = None, catalog: str | None = None, *,
                 pinned: dict | None = None, adapter_ids: list[str] | None = None, device: str = "auto",
                 dtype: str = "auto", torch_threads: int | None = None, keep_columns: list[str] | None = None,
                 engine_report: bool = False, **options):
        unknown = sorted(set(options) - PREDICTOR_OPTIONS)
        if unknown:
            raise TypeError(f"MloraPredictor: unknown option(s) {unknown}; known: {sorted(PREDICTOR_OPTIONS)}")
        if options.get("prompt_ids_column") or options.get("messages_column"):
            options.setdefault("prompt_column", None)
        self.keep_columns = None if keep_columns is None else list(keep_columns)
        # engine_report: this actor's id, its reports so far and the rows it ran (class docstring)
        self.engine_report = engine_report
        self._actor, self._reports, self._rows = uuid.uuid4().hex, 0, 0
        self.opts = JobConfig(input="", output="", base=base, adapters_dir=adapters, catalog_file=catalog,
                              device=device, dtype=dtype, **options)
        self.opts.validate()
        if torch_threads:
            torch.set_num_threads(torch_threads)
        if pinned is None:
            pinned = (pin_adapters(base, adapters, catalog, adapter_ids, allow_pickle=self.opts.allow_pickle)
                      if (adapters or catalog) else {})
        dev = resolve_device(device)
        self.session = EngineSession(self.opts, pinned, dev, resolve_dtype(dtype, load_config(base).dtype, dev))
        # closed when collected, or at exit: registered after the follower ranks started, so it runs
        # before multiprocessing's exit hook, which would wait for followers still waiting on rank 0
        self._closer = weakref.finalize(self, self.session.close)
        self._closer.atexit = False
        atexit.register(self._closer)

    def __call__(self, batch):
        as_pandas = type(batch).__module__.startswith("pandas")
        table = _to_table(batch)
        o = self.opts
        roles = [c for c in (o.id_column, o.prompt_column, o.prompt_ids_column, o.messages_column, o.adapter_column,
                             o.max_new_tokens_column) if c]
        missing = [c for c in roles if c not in table.column_names]
        if missing:
            raise ValueError(f"E_INPUT_COLUMN_MISSING: batch has no column(s) {missing}; it has "
                             f"{table.column_names} (name them with id_column=, prompt_column=, ...)")
        if self.keep_columns is None:  # every column but the two that mlora's output has itself
            passthrough = [c for c in table.column_names if c not in (o.id_column, o.adapter_column)]
        else:
            passthrough = self.keep_columns
            absent = [c for c in passthrough if c not in table.column_names]
            if absent:
                raise ValueError(f"E_INPUT_COLUMN_MISSING: keep_columns {absent} are not in the batch "
                                 f"({table.column_names})")
        clash = [c for c in passthrough if c in OUTPUT_COLUMNS or (self.engine_report and c == ENGINE_REPORT)]
        if clash:
            raise ValueError(f"E_INPUT_USAGE: batch column(s) {clash} would clash with mlora's output columns; "
                             "rename them or leave them out with keep_columns=")
        col = lambda name: table.column(name).to_pylist() if name else None  # noqa: E731
        ids = col(o.id_column)
        if None in ids:
            raise ValueError(f"E_INPUT_NULL_ID: row {ids.index(None)} of the batch has a null id; fill in every id")
        n = table.num_rows
        batch_ = InputBatch(0, ids, col(o.prompt_column), col(o.prompt_ids_column), col(o.adapter_column),
                            col(o.max_new_tokens_column) or [None] * n, None, col(o.messages_column))
        s = self.session
        results = s.run(requests_of(batch_, o, s.tokenizer, s.vocab_size))
        records = [None] * n
        for r in results:
            records[r.row] = s.record(r)
        id_field = pa.field("id", table.schema.field(o.id_column).type)
        out = pa.Table.from_pylist(records, schema=pa.schema([id_field, *RESULT_FIELDS]))
        for name in reversed(passthrough):
            out = out.add_column(0, table.schema.field(name), table.column(name))
        if self.engine_report:
            out = out.append_column(pa.field(ENGINE_REPORT, pa.string()), self._report_column(n))
        return out.to_pandas() if as_pandas else out

    def _report_column(self, n: int) -> pa.Array:
        """The ``engine_report`` column of a batch of ``n`` rows: the cumulative report on its last row."""
        self._rows += n
        if not n:
            return pa.array([], pa.string())
        self._reports += 1
        text = encode_report(self._actor, self._reports, session_report(self.session, self._rows))
        return pa.array([None] * (n - 1) + [text], pa.string())

    def close(self) -> None:
        """Stop the engine: its adapter threads and, under tensor parallelism, its follower ranks
        (once; also done when the predictor is collected or the process exits)."""
        self._closer()
        atexit.unregister(self._closer)


def _to_table(batch) -> pa.Table:
    if isinstance(batch, pa.Table):
        return batch
    if type(batch).__module__.startswith("pandas"):
        return pa.Table.from_pandas(batch, preserve_index=False)
    if isinstance(batch, dict):
        return pa.table({k: pa.array(list(v)) for k, v in batch.items()})
    raise TypeError(f"MloraPredictor takes a pandas DataFrame, a pyarrow Table or a dict of columns, "
                    f"not {type(batch).__name__}")


def read_window(items: dict, opts: JobConfig, fingerprint: list, batch_rows: int):
    """Ray Data UDF: rows ``[lo, hi)`` of each window item, sorted by adapter then
    position, yielded as tables of at most ``batch_rows`` rows (the module docstring)."""
    source = open_input(opts.input, input_spec(opts))
    if source.fingerprint() != fingerprint:
        raise JobInputError("E_INPUT_CHANGED", f"{opts.input} changed after the job started; rerun the job on a "
                            "stable input")
    for lo, hi in zip(items["lo"], items["hi"]):
        rows, kept = [], []
        for b in source.batches(int(lo), max(1, min(batch_rows, 8192)), end_row=int(hi)):
            mnt = b.max_new_tokens
            for i in range(len(b)):
                rows.append((b.adapters[i] or "", b.first_row + i, b.ids[i],
                             b.prompts[i] if b.prompts is not None else None,
                             b.prompt_ids[i] if b.prompt_ids is not None else None, b.adapters[i], mnt[i],
                             b.messages[i] if b.messages is not None else None))
            kept.append(b.kept)
        order = sorted(range(len(rows)), key=lambda k: rows[k][:2])  # adapter, then input order
        cols = {ROW: pa.array([rows[k][1] for k in order], pa.int64()),
                ID: pa.array([rows[k][2] for k in order], source.id_type),
                ADAPTER: pa.array([rows[k][5] for k in order], pa.string()),
                MAX_NEW: pa.array([rows[k][6] for k in order], pa.int64())}
        if opts.prompt_ids_column:
            cols[PROMPT_IDS] = pa.array([rows[k][4] for k in order], pa.list_(pa.int64()))
        elif opts.messages_column:
            cols[MESSAGES] = pa.array([rows[k][7] for k in order])
        else:
            cols[PROMPT] = pa.array([rows[k][3] for k in order], pa.string())
        table = pa.table(cols)
        if opts.keep_columns:
            kept_table = pa.concat_tables(kept).take(pa.array(order, pa.int64()))
            for name in kept_table.column_names:
                table = table.append_column(kept_table.schema.field(name), kept_table.column(name))
        for start in range(0, table.num_rows, batch_rows):
            yield table.slice(start, batch_rows)


def _ray_failure(exc: BaseException) -> JobError:
    """The JobError a failure inside Ray stops the job with (module docstring)."""
    cause = exc
    seen = set()
    while getattr(cause, "cause", None) is not None and id(cause) not in seen:  # RayTaskError wraps the user's
        seen.add(id(cause))
        cause = cause.cause
    code = getattr(cause, "code", None)
    if code and isinstance(cause, ValueError):
        return JobError(code, getattr(cause, "message", str(cause)), 2 if code.endswith("_USAGE") else 1)
    if isinstance(cause, JobError):
        return cause
    return JobError(code or "E_RAY_FAILED", f"the Ray job failed ({type(cause).__name__}: "
                    f"{str(cause).strip().splitlines()[-1] if str(cause).strip() else ''}); committed shards are "
                    "kept: rerun with --resume (MLORA_DEBUG=1 shows the Ray traceback)", 3)


def run_ray_job(opts: JobConfig, plan, progress=None, note=None):
    """``batch-run --engine ray`` (module docstring)."""
    import torch

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=opts.ray_address, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    try:
        resources = ray.cluster_resources()
        gpus, cpus = int(resources.get("GPU", 0)), max(1, int(resources.get("CPU", 1)))
        if opts.device not in ("auto", "cuda", "cpu"):
            raise JobError("E_DEVICE", f"--device must be auto, cuda or cpu, not {opts.device!r}", 2)
        if opts.device == "cuda" and not gpus:
            raise JobError("E_DEVICE", "--device cuda was asked for but the Ray cluster has no GPU")
        on_gpu = opts.device == "cuda" or (opts.device == "auto" and gpus > 0)
        node_gpus = [int(node["Resources"].get("GPU", 0)) for node in ray.nodes() if node.get("Alive")]
        actors = ray_actors(on_gpu, node_gpus, cpus, opts.num_workers, opts.tensor_parallel_size)
        prep = prepare_job(opts, torch.device("cuda" if on_gpu else "cpu"))
        if prep.sink is None:
            return prep.summary
        if prep.tokenizer is None and note:
            note(NO_TOKENIZER_NOTE)
        prep.summary.device = f"ray: {'cuda' if on_gpu else 'cpu'} x{actors.count}"
        if opts.tensor_parallel_size > 1:
            prep.summary.device += f" ({opts.tensor_parallel_size} ranks each)"
        try:
            return _drive(ray, prep, actors, on_gpu, progress)
        except BaseException:
            prep.sink.close_after_failure()  # what is contiguous so far; rows after a gap run again on --resume
            raise
    finally:
        if started_here:
            ray.shutdown()


def _drive(ray, prep, actors: RayActors, on_gpu: bool, progress):
    opts = prep.opts
    n = actors.count
    batch_rows = opts.schedule_window
    window = batch_rows * n
    windows = [{"lo": lo, "hi": min(lo + window, prep.source.num_rows)}
               for lo in range(prep.start_row, prep.source.num_rows, window)]
    metrics = JobMetrics()
    writer = RowWriter(prep.sink, prep.summary, metrics)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # mlora's own progress is on stderr
    options = {k: getattr(opts, k) for k in PREDICTOR_OPTIONS if k not in ("device", "dtype")}
    options.update(id_column=ID, prompt_column=None if (opts.prompt_ids_column or opts.messages_column) else PROMPT,
                   prompt_ids_column=PROMPT_IDS if opts.prompt_ids_column else None,
                   messages_column=MESSAGES if opts.messages_column else None, adapter_column=ADAPTER,
                   max_new_tokens_column=MAX_NEW)
    predictor = dict(base=opts.base, pinned=prep.pinned, device="cuda" if on_gpu else "cpu",
                     keep_columns=[ROW, *opts.keep_columns], engine_report=True,
                     dtype=str(prep.dtype).removeprefix("torch."),
                     torch_threads=actors.threads, **options)
    latest = LatestReports()
    ds = ray.data.from_items(windows) if windows else None
    if ds is not None:
        # Read tasks ask for no CPU: the actors may hold every CPU of the cluster (a CPU job), and
        # reading is light. Their resources differ from the actors', so Ray does not fuse the read
        # into the actors (fused, one actor would read and run a whole window alone).
        ds = ds.map_batches(read_window, batch_size=1, batch_format="pyarrow", num_cpus=0,
                            fn_kwargs=dict(opts=opts, fingerprint=prep.source.fingerprint(), batch_rows=batch_rows))
        ds = ds.map_batches(MloraPredictor, batch_size=batch_rows, batch_format="pyarrow",
                            compute=ray.data.ActorPoolStrategy(size=n), fn_constructor_kwargs=predictor,
                            num_gpus=actors.num_gpus, num_cpus=actors.num_cpus)
        names = [f.name for f in prep.sink.schema]
        it = iter(ds.iter_batches(batch_size=None, batch_format="pyarrow"))
        try:
            while True:
                try:
                    table = next(it, None)
                except Exception as exc:  # noqa: BLE001 - a failure inside Ray
                    if os.environ.get("MLORA_DEBUG") == "1":
                        raise
                    raise _ray_failure(exc) from None
                if table is None:
                    break
                for text in pc.drop_null(table.column(ENGINE_REPORT)).to_pylist():
                    latest.add(text)
                rows = table.column(ROW).to_pylist()
                records = table.select(names).to_pylist()
                for row, record in zip(rows, records):
                    committed = prep.sink.output.next_row
                    writer.add(row, record)
                    # progress at every shard commit (Ray may hand over many rows in one table)
                    if progress and prep.sink.output.next_row != committed:
                        progress(prep.summary, writer.progress(workers=n))
                if progress:
                    progress(prep.summary, writer.progress(workers=n))
        finally:
            close = getattr(it, "close", None)
            if close:
                close()
    # each actor's latest report once (an actor that ran no batch: no report, no rows)
    reports = latest.reports()
    prep.summary.engine, prep.summary.bank = merge_reports(metrics, prep.pinned, reports)
    ran = [(r.rows, r.generated_tokens) for r in reports] + [(0, 0)] * max(0, n - len(reports))
    prep.summary.workers = [{"worker": i, "device": "cuda" if on_gpu else "cpu", "rows": rows,
                             "generated_tokens": tokens, "status": "ok"} for i, (rows, tokens) in enumerate(ran)]
    return finish_job(prep, metrics)


__all__ = ["MloraPredictor", "pin_adapters", "run_ray_job", "read_window", "INSTALL_HINT"]
