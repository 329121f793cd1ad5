"""Programmatic dependent launch (PDL) of the decoder layer's own kernels (opt-in).

Owns the switch ``MLORA_PDL_LAYER=1`` (twenty-seventh session; built on the CPU, not yet
measured on a GPU): the add+RMSNorm, RoPE + KV write, SiLU product, paged attention and
split-merge launches become programmatic dependents of the kernel before them, on GPUs
that have PDL (Hopper and later; ``mlora.kernels.triton_sgmv._pdl_supported``). Each such
kernel first lets its own dependent launch (``griddepcontrol.launch_dependents``), then waits
for the kernel before it to complete (``griddepcontrol.wait``) before it loads anything: so
its launch and block scheduling overlap the previous kernel's tail, and, every program
waiting before its first load or store, a chain of them is as ordered as plain launches (a
kernel completes only after the one before it). A plain launch (a cuBLAS GEMM) still waits
for everything before it. The LoRA expand has used the same mechanism behind its shrink
since the eleventh session (~1.4 µs per launch pair on the H200, seventeenth session).
"""

from __future__ import annotations

import torch

from .envknobs import env_choice


def layer_pdl(device: torch.device) -> bool:
    """Whether the layer's kernels launch as programmatic dependents on ``device``:
    ``MLORA_PDL_LAYER`` is ``1`` (read at each launch: once per capture in a CUDA graph, so an
    A/B run can switch it between engines; ValueError for a value other than 0 or 1) and the
    device has PDL."""
    if env_choice("MLORA_PDL_LAYER", ("0", "1"), "0") != "1":
        return False
    from mlora.kernels.triton_sgmv import _pdl_supported  # deferred: importing triton is slow

    return _pdl_supported(torch.device(device))


def launch_options(pdl: bool) -> dict:
    """The Triton launch keywords of a programmatic dependent (none for a plain launch)."""
    return {"launch_pdl": True} if pdl else {}
