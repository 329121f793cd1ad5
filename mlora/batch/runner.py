"""Run one ``mlora batch-run`` job: the entry point of the batch engine.

Owns :func:`run_job`: validate the configuration, decide where the engines run
(this process, worker processes or Ray: ``mlora.batch.scaleout``), prepare the job
(``mlora.batch.job.prepare``) and drive it to its last row; and the single-process
run (:func:`run_single`), which feeds one engine a bounded window of rows and hands
each finished row to the writer. Builds engines only through ``EngineSession``
and writes OUTPUT only through ``job.prepare``'s writer.
"""

from __future__ import annotations

from mlora.batch.config import JobConfig
from mlora.batch.engine.engine import Result
from mlora.batch.job.prepare import NO_TOKENIZER_NOTE, JobSummary, PreparedJob, RowWriter, finish_job, prepare_job
from mlora.batch.job.session import EngineSession, requests_of
from mlora.batch.job.sizing import release_device_memory
from mlora.batch.scaleout.coordinator import run_workers
from mlora.batch.scaleout.placement import plan_workers


def run_job(opts: JobConfig, progress=None, note=None, phase=None) -> JobSummary:
    """Run (or resume) one batch job in this process, on worker processes (``opts.gpus`` /
    ``opts.num_workers``) or on Ray (``opts.engine == "ray"``); docs/scaleout.md.

    ``progress(summary, Progress)`` is called as rows finish; ``note(text)`` gets
    events worth a line on stderr (a worker that died, no adapter source);
    ``phase(text, rows_total, rows_done)`` names each step before the first row
    finishes (``rows_total`` None until the input is read). Raises JobError / the
    I/O and catalog errors (with codes)."""
    opts.validate()  # usage errors (exit 2) before any work
    plan = plan_workers(opts)
    if plan.engine == "ray":
        # Ray is an optional extra: its module is imported only for --engine ray
        from mlora.batch.scaleout.ray import run_ray_job

        return run_ray_job(opts, plan, progress, note)
    phase = phase or (lambda text, rows_total, rows_done: None)
    prep = prepare_job(opts, plan.device, phase, note)
    if prep.sink is None:
        return prep.summary
    if prep.tokenizer is None and note:
        note(NO_TOKENIZER_NOTE)
    try:
        if plan.places:
            phase(f"starting {len(plan.places)} workers", prep.summary.rows, prep.start_row)
            return run_workers(prep, plan.places, progress, note)
        return run_single(prep, progress, phase)
    except BaseException:
        prep.sink.close_after_failure()  # what is contiguous so far; rows after a gap run again on --resume
        raise


def run_single(prep: PreparedJob, progress, phase=None) -> JobSummary:
    """The job on one engine in this process."""
    opts = prep.opts
    if phase:
        phase("loading the weights", prep.summary.rows, prep.start_row)
    session = EngineSession(opts, prep.pinned, prep.device, prep.dtype)
    if phase:  # the first iterations compile the kernels (and capture decode graphs on a GPU)
        phase("compiling and starting the first rows", prep.summary.rows, prep.start_row)
    writer = RowWriter(prep.sink, prep.summary, session.metrics)
    kept: dict[int, dict] = {}
    # rows handed to the engine ahead of time: the window its adapter-aware admission
    # can reorder within (the sink buffers at most this many out-of-order results)
    queue_limit = max(8 * opts.max_num_seqs, opts.schedule_window)

    def emit(res: Result) -> None:
        record = session.record(res)  # noqa: F821 - the closure's cell, cleared by `del session` below
        record.update(kept.pop(res.row, {}))
        writer.add(res.row, record)

    batches = prep.source.batches(start_row=prep.start_row, batch_rows=max(64, opts.max_num_seqs))
    try:
        _drive(session, batches, prep, kept, emit, progress, writer, queue_limit)
    finally:
        session.close()
    prep.summary.engine, prep.summary.bank = session.stats()
    metrics = session.metrics
    del session  # (emit's cell too) the model, the KV cache or arena, the slot bank
    release_device_memory(prep.device)
    return finish_job(prep, metrics)


def _drive(session, batches, prep, kept, emit, progress, writer, queue_limit) -> None:
    """Feed input batches to the engine (at most ``queue_limit`` rows queued) and step it until done."""
    engine = session.engine
    exhausted = False
    while True:
        while not exhausted and engine.num_queued < queue_limit:
            batch = next(batches, None)
            if batch is None:
                exhausted = True
                break
            for req_or_err in requests_of(batch, prep.opts, prep.tokenizer, prep.config.vocab_size, kept):
                if isinstance(req_or_err, Result):
                    emit(req_or_err)
                else:
                    err = engine.add(req_or_err)
                    if err is not None:
                        emit(err)
        if not engine.has_work():
            if exhausted:
                break
            continue
        for res in engine.step():
            emit(res)
        if progress:
            active = len({s.req.adapter for s in engine.running if s.req.adapter is not None})
            progress(prep.summary, writer.progress(len(engine.running), active))
