"""How the base GEMMs of a forward are issued, by the forward's row count (issue step 7).

Owns two call-shape choices for the same products, both A/B knobs read once per forward
(off by default until a GPU run says otherwise):

* ``MLORA_GATE_UP_SPLIT_ROWS=LO:HI``: a forward of LO..HI rows (inclusive) computes the
  fused gate/up projection as two GEMMs, one per half of the weight, each written into
  its half of one ``[rows, 2 * intermediate]`` output (the layout every consumer reads).
  Why: at 256 rows the fused 28,672-wide GEMM gets 224 output tiles of cuBLAS's choice
  on 132 SMs; the two 14,336-wide halves measured 92.6 us against 99.0 (twenty-fourth
  session, ``scripts/gemm_probe.py``) and lost at 64 rows (75.8 against 71.5).
* ``MLORA_BLAS_ROWS=LO:HI``: a forward of LO..HI rows prefers cuBLASLt
  (``torch.backends.cuda.preferred_blas_library``, restored after the forward). At 64 rows
  the layer's GEMMs plus the lm_head summed 4.70 ms with it against 4.93 (same probe);
  at 256 rows 6.50 against 6.46.

The products are the same either way (fp32 accumulation in both libraries; a split only
partitions the output columns); what may differ is the kernel cuBLAS picks and so the
rounding order within a dot product. ``off`` or unset: the plain ``F.linear`` calls.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from mlora.batch.envknobs import env_row_range

GATE_UP_SPLIT_ENV = "MLORA_GATE_UP_SPLIT_ROWS"
BLAS_ROWS_ENV = "MLORA_BLAS_ROWS"


def _within(rows: int, bounds: tuple[int, int] | None) -> bool:
    return bounds is not None and bounds[0] <= rows <= bounds[1]


class GemmPlan:
    """The call-shape choices of one forward of ``rows`` rows, read from the environment."""

    def __init__(self, rows: int, device: torch.device):
        self.split_gate_up = _within(rows, env_row_range(GATE_UP_SPLIT_ENV))
        self.blas = "cublaslt" if device.type == "cuda" and _within(rows, env_row_range(BLAS_ROWS_ENV)) else None

    @contextlib.contextmanager
    def library(self):
        """The forward's BLAS preference around its GEMMs, the previous one restored after."""
        if self.blas is None:
            yield
            return
        saved = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(self.blas)
        try:
            yield
        finally:
            torch.backends.cuda.preferred_blas_library(saved)

    def gate_up(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` ([rows, 2I]) of the fused gate/up weight [2I, d]: one GEMM, or with
        ``split_gate_up`` one per half written in place into the halves of the output."""
        if not self.split_gate_up:
            return F.linear(x, weight)
        half = weight.shape[0] // 2
        out = x.new_empty(x.shape[0], weight.shape[0])
        torch.mm(x, weight[:half].t(), out=out[:, :half])
        torch.mm(x, weight[half:].t(), out=out[:, half:])
        return out
