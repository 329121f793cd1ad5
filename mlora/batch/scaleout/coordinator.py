"""``mlora batch-run --gpus`` / ``--num-workers``: one coordinator, one engine per worker process.

Owns the worker processes of a job and the movement of rows between them and
OUTPUT: reading and tokenizing the input (the same ``requests_of`` as one
process), assigning rows (``assign.Dispatcher``), collecting finished rows
into the job's :class:`~mlora.batch.job.prepare.RowWriter` (the ResultSink: shards in
input order, one manifest, ``_SUCCESS``), merging the workers' metrics (``engines.py``), and
what happens when a worker dies. Must not know how an engine runs a row
(``worker.py``, ``session.py``).

Protocol (one duplex pipe per worker; ``multiprocessing`` spawn context, so a
worker starts with a fresh interpreter and may use CUDA)::

    coordinator -> worker   ("rows", [Request, ...])     run these rows
                            ("stop",)                     no more work: report and exit
    worker -> coordinator   ("ready", info)              engine built
                            ("done", [(row, record)], status)  finished rows (records without kept columns)
                            ("final", engine metrics, adapters used, engine stats, bank stats)
                            ("error", code, message, exit code)  the worker failed and exits

Guarantees:

* Every row exactly once. A row is outstanding at one worker at a time, and a
  record is accepted only for a row outstanding at the worker that sent it.
  The output is the single-process output: same rows, same shards (the
  ResultSink commits shards over contiguous input rows, whoever ran them).
* A worker that dies (kill -9, the out-of-memory killer, a crash): the rows it
  had finished and sent are kept (its pipe is read to the end first), its
  unfinished rows go back to the queue and the other workers run them; a note
  goes to stderr and ``summary.workers[i]["status"]`` says ``died``. With no
  worker left the job stops with ``E_WORKER_DIED`` (exit 3): committed shards
  stay and ``--resume`` completes the job, with any number of workers. A dead
  worker's engine metrics are lost (its rows are counted).
* A worker that raises (a model that cannot load, CUDA out of memory) stops
  the job with that error's code and exit code, as one process would: the
  same error would most likely hit the other workers too.
* Memory: the input is read in segments of ``segment_rows`` rows; the next
  segment is read when every row of the current one has been handed out, so
  the coordinator holds at most about two segments of rows and results.

Assignment: ``assign.py``. Each worker holds at most ``2 * max_num_seqs``
rows (a full batch running and a full batch queued); chunks are up to
``max_num_seqs`` rows of one adapter, smaller at the end of the input
(``ceil(queued / (2 * workers))``), and at the end no worker holds more
than its share of what is left, so the last rows spread over every worker.
"""

from __future__ import annotations

import math
import multiprocessing
import pickle
import queue
import threading
import time
from multiprocessing.connection import wait

from mlora.batch.engine.engine import Request, Result
from mlora.batch.errors import JobError
from mlora.batch.job.metrics import JobMetrics
from mlora.batch.job.prepare import PreparedJob, RowWriter, finish_job
from mlora.batch.job.session import requests_of, result_record
from mlora.batch.scaleout.assign import Dispatcher
from mlora.batch.scaleout.engines import EngineReport, merge_reports
from mlora.batch.scaleout.placement import WorkerPlace
from mlora.batch.scaleout.worker import worker_main

STOP_TIMEOUT_S = 60.0  # a worker told to stop reports within this, or is killed


class _Worker:
    def __init__(self, place: WorkerPlace, process, conn):
        self.place, self.process, self.conn = place, process, conn
        # sends go through a thread: the loop must keep reading while a large chunk waits
        # for the worker to read it (else both sides can block on full pipes)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.sender = threading.Thread(target=self._send_loop, name=f"mlora-send-{place.index}", daemon=True)
        self.sender.start()
        self.ready = False
        self.alive = True
        self.outstanding: set[int] = set()
        self.rows = 0
        self.status = (0, 0, 0)  # running, active adapters, generated tokens (latest report)
        self.final = None

    def send(self, msg) -> None:
        self.outbox.put(msg)

    def _send_loop(self) -> None:
        while True:
            msg = self.outbox.get()
            if msg is None:
                return
            try:
                self.conn.send(msg)
            except (OSError, ValueError):  # the worker died (its sentinel tells the loop) or the pipe is closed
                return

    def close(self) -> None:
        self.outbox.put(None)
        self.sender.join(5)
        self.conn.close()

    def summary(self, state: str) -> dict:
        return {"worker": self.place.index, "device": self.place.label, "rows": self.rows,
                "generated_tokens": self.status[2], "status": state}


def run_workers(prep: PreparedJob, places: list[WorkerPlace], progress=None, note=None,
                segment_rows: int | None = None) -> "JobSummary":  # noqa: F821
    """Run the prepared job on one worker process per place (module docstring)."""
    opts = prep.opts
    if segment_rows is None:
        segment_rows = max(4 * opts.max_num_seqs, opts.schedule_window) * len(places)
    coord = _Coordinator(prep, places, progress, note or (lambda text: None), segment_rows)
    try:
        return coord.run()
    finally:
        coord.shutdown()


class _Coordinator:
    def __init__(self, prep: PreparedJob, places, progress, note, segment_rows: int):
        self.prep, self.opts = prep, prep.opts
        self.progress, self.note, self.segment_rows = progress, note, segment_rows
        self.dispatcher = Dispatcher()
        self.requests: dict[int, Request] = {}  # queued or outstanding
        self.kept: dict[int, dict] = {}
        self.batches = prep.source.batches(start_row=prep.start_row, batch_rows=max(64, self.opts.max_num_seqs))
        self.read_end = prep.start_row
        self.total = prep.source.num_rows
        self.target = 2 * self.opts.max_num_seqs  # rows held by one worker
        self.writer: RowWriter | None = None
        self.metrics = None
        self.workers = self._spawn(places)
        labels = [p.label for p in places]
        prep.summary.device = ",".join(labels) if places[0].device == "cuda" else f"cpu x{len(places)}"
        if self.opts.tensor_parallel_size > 1:
            prep.summary.device += f" ({self.opts.tensor_parallel_size} ranks each)"

    # -- processes ---------------------------------------------------------

    def _spawn(self, places: list[WorkerPlace]) -> list[_Worker]:
        ctx = multiprocessing.get_context("spawn")
        payload = pickle.dumps((self.opts, self.prep.pinned, self.prep.device.type, self.prep.dtype))
        # a tensor-parallel worker starts its follower ranks, which a daemon process may not;
        # shutdown() stops every worker either way
        daemon = self.opts.tensor_parallel_size == 1
        workers = []
        for place in places:
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=worker_main, name=f"mlora-worker-{place.index}", daemon=daemon,
                               args=(place.index, child, place.cuda_visible, place.threads, payload))
            proc.start()
            child.close()  # only the worker holds its end: its death reads as end-of-file here
            workers.append(_Worker(place, proc, parent))
        return workers

    def shutdown(self) -> None:
        """Stop every worker still running (after success, an error or Ctrl-C)."""
        for w in self.workers:
            if w.process.is_alive():
                w.process.terminate()
        for w in self.workers:
            w.process.join(5)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.close()

    @property
    def alive(self) -> list[_Worker]:
        return [w for w in self.workers if w.alive]

    # -- the loop ----------------------------------------------------------

    def run(self):
        prep = self.prep
        while True:
            if not self.alive:
                raise JobError("E_WORKER_DIED", "every worker process died; committed shards are kept: rerun with "
                               "--resume to finish the job", 3)
            if self.writer is not None and self._finished():
                break
            self._wait_and_handle()
            if self.writer is not None:
                self._read_segment_if_due()
                self._feed()
        self._stop_workers()
        summary = prep.summary
        summary.engine, summary.bank = merge_reports(self.metrics, prep.pinned,
                                                     [w.final for w in self.workers if w.final is not None])
        summary.workers = [w.summary("ok" if w.final is not None else "died") for w in self.workers]
        return finish_job(prep, self.metrics)

    def _finished(self) -> bool:
        return (self.read_end >= self.total and not self.dispatcher.pending_rows
                and not any(w.outstanding for w in self.workers))

    def _wait_and_handle(self) -> None:
        live = self.alive
        ready = wait([w.conn for w in live] + [w.process.sentinel for w in live])
        for w in live:
            if w.conn in ready:
                try:
                    self._handle(w, w.conn.recv())
                except (EOFError, OSError):
                    self._died(w)
            elif w.process.sentinel in ready:
                self._died(w)

    def _handle(self, w: _Worker, msg) -> None:
        kind = msg[0]
        if kind == "ready":
            w.ready = True
            if self.writer is None:  # the first engine is up: the job's clock starts (as in one process)
                self.metrics = JobMetrics()
                self.writer = RowWriter(self.prep.sink, self.prep.summary, self.metrics)
        elif kind == "done":
            for row, record in msg[1]:
                if row not in w.outstanding:
                    raise JobError("E_WORKER_PROTOCOL", f"worker {w.place.index} returned row {row}, which it was "
                                   "not running; committed shards are kept: rerun with --resume", 3)
                w.outstanding.discard(row)
                self.requests.pop(row, None)
                record.update(self.kept.pop(row, {}))
                self.writer.add(row, record)
            w.rows += len(msg[1])
            w.status = msg[2]
            if self.progress:
                alive = self.alive
                self.progress(self.prep.summary, self.writer.progress(
                    sum(x.status[0] for x in alive), sum(x.status[1] for x in alive), len(alive)))
        elif kind == "final":
            w.final = EngineReport(*msg[1:])
        elif kind == "error":
            _, code, message, exit_code = msg
            if exit_code == 3:
                message += "; committed shards are kept: rerun with --resume"
            raise JobError(code, f"worker {w.place.index} ({w.place.label}): {message}", exit_code)
        else:
            raise JobError("E_WORKER_PROTOCOL", f"worker {w.place.index} sent {kind!r}", 3)

    def _died(self, w: _Worker) -> None:
        """Read what the dead worker sent before it died, then give its unfinished rows to the others."""
        w.alive = False
        try:
            while w.conn.poll():
                self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            pass
        w.alive = False  # _handle may not resurrect it
        w.process.join(1)
        self.dispatcher.forget(w.place.index)
        lost = sorted(w.outstanding)
        w.outstanding.clear()
        self.dispatcher.requeue([(r, self.requests[r].adapter, _cost(self.requests[r])) for r in lost])
        if w.final is not None and not lost:
            return  # it had reported and was exiting anyway
        left = len(self.alive)
        self.note(f"worker {w.place.index} ({w.place.label}) died (exit code {w.process.exitcode}); "
                  f"{len(lost)} unfinished row(s) go to the {left} remaining worker(s)" if left else
                  f"worker {w.place.index} ({w.place.label}) died (exit code {w.process.exitcode}); no worker is left")

    # -- input and assignment -----------------------------------------------

    def _read_segment_if_due(self) -> None:
        """Read and queue segments once every queued row has been handed out (until one
        queues a row: a segment may hold only rows refused here)."""
        while not self.dispatcher.pending_rows and self.read_end < self.total:
            self._read_segment()

    def _read_segment(self) -> None:
        prep, read = self.prep, 0
        while read < self.segment_rows:
            batch = next(self.batches, None)
            if batch is None:
                break
            for r in requests_of(batch, self.opts, prep.tokenizer, prep.config.vocab_size, self.kept):
                if isinstance(r, Result):  # refused before it could run (null prompt, token range)
                    record = result_record(r, prep.pinned, prep.tokenizer)
                    record.update(self.kept.pop(r.row, {}))
                    self.writer.add(r.row, record)
                else:
                    self.requests[r.row] = r
                    self.dispatcher.add(r.row, r.adapter, _cost(r))
            read += len(batch)
            self.read_end = batch.first_row + len(batch)
        if read == 0:
            self.read_end = self.total

    def _feed(self) -> None:
        """Hand chunks to every ready worker with room (fewest rows held first)."""
        d = self.dispatcher
        alive = self.alive  # shares count workers still starting: they get theirs when ready
        for w in sorted(alive, key=lambda x: (len(x.outstanding), x.place.index)):
            while w.ready and d.pending_rows:
                room = self._room(w, alive)
                size = self.opts.max_num_seqs
                if self.read_end >= self.total:  # the last rows: small chunks, spread over every worker
                    size = min(size, math.ceil(d.pending_rows / (2 * len(alive))))
                chunk = d.take(w.place.index, min(room, size))
                if chunk is None:
                    break
                rows = chunk[1]
                w.outstanding.update(rows)
                w.send(("rows", [self.requests[r] for r in rows]))

    def _room(self, w: _Worker, alive: list[_Worker]) -> int:
        cap = self.target
        if self.read_end >= self.total:  # no worker holds more than its share of what is left
            left = self.dispatcher.pending_rows + sum(len(x.outstanding) for x in alive)
            cap = min(cap, math.ceil(left / len(alive)))
        return cap - len(w.outstanding)

    def _stop_workers(self) -> None:
        for w in self.alive:
            w.send(("stop",))
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(w.alive and w.final is None for w in self.workers) and time.monotonic() < deadline:
            self._wait_and_handle_final(deadline)

    def _wait_and_handle_final(self, deadline: float) -> None:
        live = [w for w in self.workers if w.alive and w.final is None]
        ready = wait([w.conn for w in live] + [w.process.sentinel for w in live], max(0.0, deadline - time.monotonic()))
        for w in live:
            if w.conn in ready:
                try:
                    self._handle(w, w.conn.recv())
                except (EOFError, OSError):
                    w.alive = False
            elif w.process.sentinel in ready:
                w.alive = False


def _cost(req: Request) -> int:
    """Estimated tokens of a row: what it costs to prefill and to generate at most."""
    return len(req.prompt_ids) + req.max_new_tokens

