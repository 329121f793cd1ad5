"""The tensor-parallel process group: rank processes started by mlora, their rendezvous, their collective.

Owns the start of N rank processes (``run_ranks``: torch.multiprocessing spawn, no torchrun), the
rendezvous (a TCP store the launcher holds on a free localhost port, so no port is guessed), a
rank's membership (``join_group`` / ``leave_group``: gloo on the CPU, NCCL between GPUs), the
collective the model calls (``GroupCollective.all_reduce``) and what a failed rank turns into
(``TPGroupError``). Must not know the model or adapters: a rank runs the function it is given.

Failure, never a hang: a collective that cannot complete (a peer died, or did not answer within
the group's timeout) raises ``E_TP_PEER_LOST`` on the ranks still in it; once any rank fails,
the launcher gives the others the group's timeout to finish or fail, stops those still running,
and raises the cause: ``E_TP_RANK_DIED`` (a rank exited without a report), else a rank's own
error with its code, else ``E_TP_RANK_HUNG`` (a rank it had to stop), else ``E_TP_PEER_LOST``.
"""

from __future__ import annotations

import pickle
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist
import torch.multiprocessing

from mlora.batch.errors import CodedError
from mlora.batch.model.tp import TPLayout

BACKENDS = ("gloo", "nccl")
HOST = "127.0.0.1"
# A collective waits this long for a slow rank (one still loading its shard of a large base, say)
# before it fails; a dead rank's peers fail at once on gloo.
DEFAULT_TIMEOUT_S = 600.0
# What a launcher waits, beyond the group's timeout, for ranks to report after the first failure,
# and for a rank that reported to exit.
STOP_GRACE_S = 2.0


class TPGroupError(CodedError, RuntimeError):
    """``code``: E_TP_BACKEND, E_TP_PEER_LOST, E_TP_RANK_DIED, E_TP_RANK_HUNG, E_TP_RANK_FAILED, or
    the code of the error a rank raised. ``details``: the failing ranks' tracebacks, if any."""

    def __init__(self, code: str, message: str, details: str = ""):
        super().__init__(code, message)
        self.details = details


class GroupCollective:
    """A rank's side of its group: its ``layout``, the in-place sum the model calls, and the
    control messages of an engine's ranks (Python objects over a gloo group: ``control``, the
    default group on the CPU, a gloo group of its own beside NCCL)."""

    def __init__(self, layout: TPLayout, timeout_s: float, control=None):
        self.layout = layout
        self.timeout_s = timeout_s
        self.control = control

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` (contiguous) over the group's ranks, in place, on every rank."""
        with self._lost_peer():
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    def broadcast_object(self, obj=None):
        """Rank 0's ``obj`` on every rank (the others pass nothing)."""
        box = [obj]
        with self._lost_peer():
            dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        out = [None] * self.layout.size
        with self._lost_peer():
            dist.all_gather_object(out, obj, group=self.control)
        return out

    @contextmanager
    def _lost_peer(self):
        try:
            yield
        except RuntimeError as e:  # gloo and NCCL raise a lost peer or a timeout as RuntimeError subclasses
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TPGroupError("E_TP_PEER_LOST", f"rank {self.layout.rank} of {self.layout.size}: a collective "
                                                 f"failed ({first}): another rank died or did not answer within "
                                                 f"{self.timeout_s:g} s; see that rank's error") from e


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise TPGroupError("E_TP_BACKEND", f"tensor-parallel backend {backend!r}: use 'gloo' (CPU) or 'nccl' (GPUs)")


def join_group(layout: TPLayout, port: int, backend: str = "gloo",
               timeout_s: float = DEFAULT_TIMEOUT_S) -> GroupCollective:
    """Join the group whose rendezvous store listens on ``port`` of this host, as ``layout.rank``.
    NCCL: make the rank's GPU current (``torch.cuda.set_device``) first."""
    _check_backend(backend)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(HOST, port, layout.size, is_master=False, timeout=timeout)
    store.set(_joining(layout.rank), "1")  # a launcher waiting for its followers stops polling their liveness
    dist.init_process_group(backend, store=store, rank=layout.rank, world_size=layout.size, timeout=timeout)
    control = None if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return GroupCollective(layout, timeout_s, control)


def _joining(rank: int) -> str:
    """The rendezvous key a rank sets on its way into the group."""
    return f"mlora/joining/{rank}"


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _rank_main(layout: TPLayout, port: int, backend: str, timeout_s: float, fn: Callable, args: tuple,
               conn: Connection) -> None:
    """A rank process: join, run ``fn``, leave, report ``("ok", result)`` or ``("error", code,
    message, traceback)`` to the launcher in one message."""
    try:
        collective = join_group(layout, port, backend, timeout_s)
        try:
            report = pickle.dumps(("ok", fn(collective, *args)))
        finally:
            leave_group()
    except CodedError as e:
        report = pickle.dumps(("error", e.code, e.message, traceback.format_exc()))
    except BaseException as e:  # anything else: reported with its type, raised by the launcher with the rank named
        report = pickle.dumps(("error", "E_TP_RANK_FAILED", f"{type(e).__name__}: {e}", traceback.format_exc()))
    try:
        conn.send_bytes(report)
    except OSError:  # the launcher is gone (a killed scale-out worker): nobody to report to
        pass
    conn.close()


@dataclass
class _Rank:
    rank: int
    process: BaseProcess
    conn: Connection
    report: tuple | None = None


def run_ranks(fn: Callable, size: int, args: tuple = (), backend: str = "gloo",
              timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
    """Run ``fn(collective, *args)`` in ``size`` new processes, one per rank of one group; return
    their results in rank order. ``fn`` must be a module's top-level function and ``fn``, ``args``
    and the results must pickle (spawned processes: guard a script's entry with
    ``if __name__ == "__main__":``). A failure raises ``TPGroupError`` (module docstring)."""
    TPLayout(0, size)
    _check_backend(backend)
    ctx = torch.multiprocessing.get_context("spawn")
    # held here for the group's life; port 0: the system picks a free one
    store = dist.TCPStore(HOST, 0, None, True, timeout=timedelta(seconds=timeout_s))
    ranks: list[_Rank] = []
    try:
        for rank in range(size):
            mine, theirs = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_rank_main, name=f"mlora-tp-rank-{rank}",
                                  args=(TPLayout(rank, size), store.port, backend, timeout_s, fn, args, theirs))
            process.start()
            theirs.close()
            ranks.append(_Rank(rank, process, mine))
        _collect(ranks, timeout_s)
    finally:  # a rank that reported gets a moment to exit by itself; any other is stopped
        for r in ranks:
            r.process.join(STOP_GRACE_S if r.report is not None and r.report[0] != "hung" else 0)
            if r.process.is_alive():
                r.process.kill()
                r.process.join()
            r.conn.close()
    failed = [r for r in ranks if r.report[0] != "ok"]
    if failed:
        raise _failure(failed, timeout_s)
    return [r.report[1] for r in ranks]


class LeadGroup:
    """A group whose rank 0 is this process (an engine's, docs/scaleout.md): the followers
    1..N-1 run ``fn(collective, *args)`` in processes of their own; ``collective`` is rank 0's."""

    def __init__(self, fn: Callable, size: int, args: tuple = (), backend: str = "gloo",
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        TPLayout(0, size)
        _check_backend(backend)
        self.timeout_s = timeout_s
        ctx = torch.multiprocessing.get_context("spawn")
        self._store = dist.TCPStore(HOST, 0, None, True, timeout=timedelta(seconds=timeout_s))
        self.ranks: list[_Rank] = []
        self._stopped = False
        try:
            for rank in range(1, size):
                mine, theirs = ctx.Pipe(duplex=False)
                process = ctx.Process(target=_rank_main, name=f"mlora-tp-rank-{rank}",
                                      args=(TPLayout(rank, size), self._store.port, backend, timeout_s, fn, args,
                                            theirs))
                process.start()
                theirs.close()
                self.ranks.append(_Rank(rank, process, mine))
            self._await_followers()
            self.collective = join_group(TPLayout(0, size), self._store.port, backend, timeout_s)
        except BaseException:
            if not self._stopped:
                self._stop(0)
            raise

    def _await_followers(self) -> None:
        """Wait until every follower is on its way into the group; one that dies first (its
        imports, its device) fails the start at once (E_TP_RANK_DIED) instead of leaving rank 0
        in the rendezvous until the group's timeout."""
        deadline = time.monotonic() + self.timeout_s
        waiting = list(self.ranks)
        while waiting and time.monotonic() < deadline:
            waiting = [r for r in waiting if not self._store.check([_joining(r.rank)])]
            if any(not r.process.is_alive() for r in waiting):
                self._stop(0)  # raises the dead rank's TPGroupError
            time.sleep(0.02)

    def finish(self) -> None:
        """Leave the group once the followers were told to stop; raise their failure, if any."""
        leave_group()
        self._stop(self.timeout_s)

    def results(self) -> list:
        """What each follower's ``fn`` returned, in rank order (after :meth:`finish`)."""
        return [r.report[1] for r in self.ranks]

    def failure(self, error: BaseException) -> BaseException:
        """The error to raise for ``error``, raised on rank 0 while the group ran: the group is
        left and the followers stopped; a follower that died or failed is the cause
        (``TPGroupError``, module docstring), else ``error`` itself."""
        leave_group()  # a follower waiting on rank 0 fails now
        try:
            self._stop(STOP_GRACE_S)
        except TPGroupError as cause:
            return cause
        return error

    def _stop(self, wait_s: float) -> None:
        self._stopped = True
        try:
            _collect(self.ranks, self.timeout_s, wait_s)
        finally:
            for r in self.ranks:
                r.process.join(STOP_GRACE_S if r.report is not None and r.report[0] != "hung" else 0)
                if r.process.is_alive():
                    r.process.kill()
                    r.process.join()
                r.conn.close()
        failed = [r for r in self.ranks if r.report is not None and r.report[0] != "ok"]
        if failed:
            raise _failure(failed, self.timeout_s)


def _collect(ranks: list[_Rank], timeout_s: float, wait_s: float | None = None) -> None:
    """Fill every rank's ``report``: its own, ``("died", exit code)`` or, for a rank still running
    ``timeout_s`` + ``STOP_GRACE_S`` after the first failure (or ``wait_s`` from now),
    ``("hung",)`` (then stopped)."""
    pending = list(ranks)
    deadline = None if wait_s is None else time.monotonic() + wait_s
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = wait([r.conn for r in pending] + [r.process.sentinel for r in pending], left)
        if not ready:
            for r in pending:
                r.report = ("hung",)
            return
        for r in [r for r in pending if r.conn in ready or r.process.sentinel in ready]:
            try:
                r.report = pickle.loads(r.conn.recv_bytes())
            except (EOFError, OSError):  # the process ended without a report
                r.process.join()
                r.report = ("died", r.process.exitcode)
            pending.remove(r)
            if r.report[0] != "ok" and deadline is None:
                deadline = time.monotonic() + timeout_s + STOP_GRACE_S


def _failure(failed: list[_Rank], timeout_s: float) -> TPGroupError:
    """The error that names the cause among the failed ranks' reports (module docstring)."""
    notes, details = [], []
    for r in failed:
        kind = r.report[0]
        if kind == "died":
            code = r.report[1]
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            notes.append(f"rank {r.rank} died ({how})")
        elif kind == "hung":
            notes.append(f"rank {r.rank} did not finish within the group's timeout ({timeout_s:g} s) and was stopped")
        else:
            notes.append(f"rank {r.rank}: {r.report[1]}: {r.report[2]}")
            details.append(f"rank {r.rank}:\n{r.report[3]}")

    def first(kinds) -> _Rank | None:
        return next((r for r in failed if kinds(r.report)), None)

    cause = (first(lambda rep: rep[0] == "died")
             or first(lambda rep: rep[0] == "error" and rep[1] != "E_TP_PEER_LOST")
             or first(lambda rep: rep[0] == "hung")
             or failed[0])
    code = {"died": "E_TP_RANK_DIED", "hung": "E_TP_RANK_HUNG"}.get(cause.report[0])
    code = code or cause.report[1]
    return TPGroupError(code, "the tensor-parallel group failed: " + "; ".join(notes)
                        + ". Fix the failing rank's cause and run again", "\n".join(details))
