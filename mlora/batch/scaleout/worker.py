"""A worker process of ``--gpus`` / ``--num-workers``: one engine, fed by the coordinator.

Owns the worker side of the protocol in ``coordinator.py``: pin its device before
anything touches CUDA, build its :class:`~mlora.batch.job.session.EngineSession`,
run the rows it is sent, send each finished row back as soon as it finishes,
and report its engine metrics when told to stop. Must not read the input or
write OUTPUT (the coordinator does both).

Imports nothing heavy at module level, and receives its setup as pickled
bytes that it loads only after setting ``CUDA_VISIBLE_DEVICES``: the spawned
child imports this module (and would import torch while unpickling the
setup) before :func:`worker_main` runs, and the variable must be set before
torch initialises CUDA. The worker then sees exactly its one GPU as ``cuda:0``;
with ``--tensor-parallel-size N`` it is rank 0 of a group and sees the group's
N GPUs, rank j's as ``cuda:j``, and the follower ranks it starts inherit the
variable (on the CPU they take as many torch threads as the worker).

Ctrl-C is ignored here (the coordinator handles it and stops the workers); a
closed pipe (the coordinator died) ends the worker quietly.

Test-only fault hook: ``MLORA_TEST_KILL_WORKER="I:K"`` makes worker I send
SIGKILL to itself right after it has sent K finished rows back
(tests/test_batch_multi.py); unset in production.
"""

from __future__ import annotations

import os
import pickle
import signal

from mlora.batch.errors import JobError

KILL_ENV = "MLORA_TEST_KILL_WORKER"


def worker_main(index: int, conn, cuda_visible: str | None, threads: int | None, payload: bytes) -> None:
    """Process entry point (spawn target). ``payload`` pickles (opts, pinned, device type, dtype)."""
    if cuda_visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _serve(index, conn, threads, payload)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the coordinator is gone: nobody to report to


def _error(exc: BaseException) -> tuple[str, str, int]:
    """(code, message, exit code) of a worker failure, mapped as the CLI maps the same error in one process."""
    code = getattr(exc, "code", None)
    if isinstance(exc, JobError):
        return exc.code, exc.message, exc.exit_code
    if isinstance(exc, ValueError) and code:
        return code, getattr(exc, "message", str(exc)), 2 if code.endswith("_USAGE") else 1
    return code or "E_RUNTIME", f"{type(exc).__name__}: {exc}", 3


def _serve(index: int, conn, threads: int | None, payload: bytes) -> None:
    # torch and the engine are imported only once worker_main has set CUDA_VISIBLE_DEVICES
    import torch

    from mlora.batch.job.session import EngineSession

    kill_after = _kill_after(index)
    try:
        opts, pinned, device_type, dtype = pickle.loads(payload)
        if threads:
            torch.set_num_threads(threads)
        device = torch.device(device_type)
        if device.type == "cuda":
            seen, own = torch.cuda.device_count(), opts.tensor_parallel_size
            if seen != own:  # fewer: a bad id; more: CUDA started before the variable was set (never share a GPU)
                raise RuntimeError(f"worker {index} sees {seen} CUDA devices, not its {own} "
                                   f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
            torch.cuda.set_device(0)
        session = EngineSession(opts, pinned, device, dtype)
    except Exception as exc:  # noqa: BLE001 - reported to the coordinator, which decides the exit code
        conn.send(("error", *_error(exc)))
        return
    engine = session.engine
    conn.send(("ready", {"device": str(device), "kv_blocks": engine.num_blocks, "slots": engine.num_slots}))
    sent = 0
    try:
        while True:
            finished = []
            # take every message waiting; block for one only when idle with nothing to send
            while conn.poll() or not (engine.has_work() or finished):
                msg = conn.recv()
                if msg[0] == "stop":
                    engine_stats, bank_stats = session.stats()
                    conn.send(("final", session.metrics.engine_state(), sorted(engine.adapters_used),
                               engine_stats, bank_stats))
                    return
                for req in msg[1]:  # ("rows", [Request, ...])
                    err = engine.add(req)
                    if err is not None:
                        finished.append(err)
            if engine.has_work():
                finished += engine.step()
            if finished:
                active = len({s.adapter for s in engine.running if s.adapter is not None})
                status = (len(engine.running), active, engine.stats["generated_tokens"])
                conn.send(("done", [(r.row, session.record(r)) for r in finished], status))
                sent += len(finished)
                if kill_after is not None and sent >= kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        raise
    except Exception as exc:  # noqa: BLE001
        conn.send(("error", *_error(exc)))
    finally:
        session.close()


def _kill_after(index: int) -> int | None:
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return None
    worker, rows = spec.split(":")
    return int(rows) if int(worker) == index else None
