"""Reference runtime operator of a joint decomposition (docs/design.md, Bundle and three-stage operator).

Owns the slow, obviously-correct three-stage product that every serving path
of a compressed collection must equal; the segmented kernels and the engine
live elsewhere (``mlora.kernels``, ``mlora.batch``).
"""

from __future__ import annotations

import torch


def joint_apply(X: torch.Tensor, U: torch.Tensor, V: torch.Tensor, core: torch.Tensor) -> torch.Tensor:
    """``X Delta^T`` for ``Delta = U Sigma V^T``, without forming Delta.

    Semantics (X [N, d_in], V [d_in, R], U [d_out, R]; core [R, R] for
    JD-Full, [R] for JD-Diag)::

        H = X @ V                     # [N, R]      shared projection (one per cluster)
        H = H @ core.T  |  H * core   # [N, R]      adapter-specific core
        Y = H @ U.T                   # [N, d_out]  shared expansion
    """
    H = X @ V
    H = H * core if core.dim() == 1 else H @ core.T
    return H @ U.T
