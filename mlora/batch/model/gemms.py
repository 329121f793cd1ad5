"""Which BLAS library runs a forward's base GEMMs, by the forward's row count.

At decode sizes the base GEMMs of a layer and the LM head are byte-bound, and cuBLASLt's
kernels for them beat the ones torch's default (cuBLAS) picks; from a few hundred rows on
the two are even (figures in BENCHMARKS.md). So a CUDA forward of
``BLAS_ROWS`` rows (inclusive bounds) prefers cuBLASLt
(``torch.backends.cuda.preferred_blas_library``) for its GEMMs, the previous preference
restored after it. Inside a CUDA graph capture the choice is captured with the kernels. Both
libraries accumulate in fp32; what differs is the kernel and so the rounding order within a
dot product (bf16 outputs may differ in the last bit; float32 jobs, the demo's check, equal).
CPU forwards are untouched.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

BLAS_ROWS = (1, 128)  # forwards of this many rows prefer cuBLASLt

_notice_lock = threading.Lock()
_notice_done = False


def blas_for(rows: int, device: torch.device) -> str | None:
    """``"cublaslt"`` for a CUDA forward of ``rows`` rows inside ``BLAS_ROWS``, else None
    (the process's preference stands)."""
    if device.type != "cuda" or not BLAS_ROWS[0] <= rows <= BLAS_ROWS[1]:
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
