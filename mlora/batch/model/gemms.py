"""Which BLAS library runs a forward's base GEMMs, by the forward's row count (issue step 7).

At decode sizes of up to ~128 rows the base GEMMs of a Llama-3-8B layer and its lm_head are
byte-bound, and cuBLASLt's kernels for them beat the ones torch's default (cuBLAS) picks:
the 32 layers plus the head summed 4.67 / 4.70-4.72 / 4.86 / 5.06 ms with it against 4.88 /
4.93 / 5.08 / 5.11 at 32 / 64 / 96 / 128 rows, 5.83 against 5.89 at 192 and about equal at
256 rows (6.50-6.54 against 6.46-6.53; ``scripts/gemm_probe.py``, twenty-fourth session). In
the engine, base decode at 64 running rows took 6.54-6.63 ms an iteration with it against
6.78 (``bench batch --max-num-seqs 64 --ab MLORA_BLAS_ROWS=off,1:128``, BENCHMARKS.md), and
256 rows the same with or without it.

So a forward of ``MLORA_BLAS_ROWS`` rows (inclusive ``LO:HI``; default ``1:128``; ``off``:
never) prefers cuBLASLt (``torch.backends.cuda.preferred_blas_library``) for its GEMMs, the
previous preference restored after it. Inside a CUDA graph capture the choice is captured
with the kernels. Both libraries accumulate in fp32; what differs is the kernel and so the
rounding order within a dot product (bf16 outputs may differ in the last bit; float32 jobs,
the demo's check, equal). CPU forwards are untouched. Measured on the H200 only: on another
GPU, ``scripts/gemm_probe.py --rows 32,64,128,256`` and ``mlora bench batch --ab
MLORA_BLAS_ROWS=off,1:128`` say whether the range suits it.

Measured and not adopted (same probe, then ``bench batch --ab``): the fused gate/up GEMM as
two GEMMs over the weight's halves, 92.6 against 99.0 us alone at 256 rows, changed nothing
in the engine's iteration (13.46-13.48 against 13.45-13.50 ms).
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

from mlora.batch.envknobs import env_row_range

BLAS_ROWS_ENV = "MLORA_BLAS_ROWS"
BLAS_ROWS_DEFAULT = (1, 128)

_notice_lock = threading.Lock()
_notice_done = False


def blas_for(rows: int, device: torch.device) -> str | None:
    """``"cublaslt"`` for a CUDA forward of ``rows`` rows inside ``MLORA_BLAS_ROWS``, else None
    (the process's preference stands)."""
    bounds = env_row_range(BLAS_ROWS_ENV, BLAS_ROWS_DEFAULT)
    if device.type != "cuda" or bounds is None or not bounds[0] <= rows <= bounds[1]:
        return None
    return "cublaslt"


def blas_library(rows: int, device: torch.device):
    """A forward's GEMMs under :func:`blas_for`'s preference (a context manager)."""
    return preferring(blas_for(rows, device))


@contextlib.contextmanager
def preferring(choice: str | None):
    """torch's BLAS preference set to ``choice`` (``"cublas"``, ``"cublaslt"``; None: left as it
    is) inside the block, the previous one restored after, also on error."""
    if choice is None:
        yield
        return
    saved = torch.backends.cuda.preferred_blas_library()
    _set_quietly(choice)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(saved)


def _set_quietly(choice: str) -> None:
    """Set the preference. torch prints a one-time "experimental feature" notice from C++ the
    first time a process prefers cuBLASLt (not a Python warning: no filter reaches it); a job's
    stderr is the user's log, so that first call runs with file descriptor 2 pointed at
    /dev/null (a few microseconds, once per process)."""
    global _notice_done
    if _notice_done:
        torch.backends.cuda.preferred_blas_library(choice)
        return
    with _notice_lock:
        saved_fd = os.dup(2)
        try:
            with open(os.devnull, "wb") as null:
                os.dup2(null.fileno(), 2)
                try:
                    torch.backends.cuda.preferred_blas_library(choice)
                finally:
                    os.dup2(saved_fd, 2)
        finally:
            os.close(saved_fd)
        _notice_done = True
