"""Adapter host images built in worker processes.

Owns a small pool of spawned processes that run ``SlotLayout.artifact`` (read
the pinned adapter files, re-hash them against the pinned digests, place the
factors, lay out the slot views, compute the validation numbers) and send the
image back as raw bytes; the receiving prefetch thread copies them into one
pinned buffer. Opt-in (``JobConfig.image_build_processes``; default: the
prefetch threads build). Builder threads share the interpreter lock with the
engine thread; worker processes do not, but pay a spawn and a copy of every image
back (the two are compared in BENCHMARKS.md, residency).

Trust: a worker only speeds up what the engine would do itself. Its image
carries the same digests and is validated on the device like any other; when
a worker fails for any reason (the adapter changed, the process died, the
result does not fit), :meth:`ProcessBuilder.build` returns None and the caller
builds the image on its own thread, which raises the error a synchronous load
would raise. Must not know slots, leases or the device.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import torch

from mlora.batch.adapters.residency.host import HostArtifact, Piece, image_buffer


def _ready() -> bool:
    """In a worker: nothing (its imports, done on unpickling this function, are the warm-up)."""
    return True


def _init_worker() -> None:
    """In a new worker: one intra-op thread. With torch's default (one per core) several
    workers oversubscribe the host's cores and slow the engine's own host work."""
    torch.set_num_threads(1)


def _build(layout, pinned) -> dict:
    """In the worker: the image of ``pinned`` as plain picklable data (with the seconds the
    worker spent on it)."""
    t0 = time.perf_counter()
    art = layout.artifact(pinned)
    pieces = []
    for p in art.pieces:
        t = p.src.detach().contiguous()
        pieces.append((p.view, p.index, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                       t.reshape(-1).view(torch.uint8).numpy().tobytes()))
    return {"key": art.key, "digest": art.digest, "name": art.name, "pages": art.pages, "meta": art.meta,
            "checks": art.checks, "pieces": pieces, "seconds": time.perf_counter() - t0}


def from_wire(wire: dict, pin: bool, pool=None) -> HostArtifact:
    """A worker's image as a HostArtifact, every piece in one buffer at 64-byte aligned
    offsets: a block of ``pool`` when one is free (``host.image_buffer``), else pinned
    when ``pin`` and there is no pool, else pageable."""
    buf, offsets, pooled = image_buffer([len(raw) for *_, raw in wire["pieces"]], pin, pool)
    flat = buf.numpy()
    pieces = []
    for (view, index, dtype, shape, raw), off in zip(wire["pieces"], offsets):
        flat[off:off + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        src = buf[off:off + len(raw)].view(getattr(torch, dtype)).view(shape)
        pieces.append(Piece(view, index, src))
    art = HostArtifact(wire["key"], wire["digest"], pieces, wire["name"], wire["pages"], wire["meta"],
                       checks=wire["checks"], transfer_ready=pooled or (pin and pool is None))
    if pooled:
        pool.own(art, buf)
    return art


MAX_BROKEN_POOLS = 3  # pools that died before the builder gives up for the rest of the job


class ProcessBuilder:
    """``processes`` spawned workers building host images (``start`` them early: the bank does
    when it is made; otherwise the first build starts them). After
    ``MAX_BROKEN_POOLS`` pools died (workers cannot start or keep crashing) it stops
    trying: every later call returns None at once."""

    def __init__(self, processes: int):
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self.built = self.failed = self.broken = 0
        # seconds summed over builds: in the workers, from submit to result here, placing the
        # result into pinned memory (the receiving thread's share)
        self.worker_s = self.round_trip_s = self.receive_s = 0.0

    def start(self) -> None:
        """Start the workers now, in the background (each spends a few seconds importing torch),
        so that the first builds do not wait for them."""
        if self._pool is None and self.broken < MAX_BROKEN_POOLS:
            self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init_worker)
            for _ in range(self.processes):
                self._pool.submit(_ready)

    def build(self, layout, pinned, pin: bool, pool=None) -> HostArtifact | None:
        """The image of ``pinned`` built by a worker, or None when the worker could not build it."""
        if self.broken >= MAX_BROKEN_POOLS:
            return None
        try:
            self.start()
            t0 = time.perf_counter()
            wire = self._pool.submit(_build, layout, pinned).result()
            t1 = time.perf_counter()
            art = from_wire(wire, pin, pool)
            self.worker_s += wire["seconds"]
            self.round_trip_s += t1 - t0
            self.receive_s += time.perf_counter() - t1
        except BrokenProcessPool:  # a worker died: start a fresh pool next time
            self.failed += 1
            self.broken += 1
            self.close()
            return None
        except Exception:  # noqa: BLE001 - the caller rebuilds on its own thread and raises the real error
            self.failed += 1
            return None
        if art.digest != pinned.semantic_sha256:
            self.failed += 1
            return None
        self.built += 1
        return art

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
