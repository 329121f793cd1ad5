"""Programmatic dependent launch (PDL) for the base path's Triton kernels (issue step 7).

A decode iteration is a chain of ~330 kernels, each depending on the one before. Between
two ordinary launches the GPU drains the first grid, flushes its writes and only then
schedules the second (about 0.8 ms of a 256-row Llama-3-8B iteration's 12.9 ms is not inside any
kernel: nineteenth session's profile). Launched with PDL on Hopper, a kernel's blocks may be
scheduled while its predecessor's last blocks still run; each then waits
(``griddepcontrol.wait``) until that predecessor has completed and its memory is visible,
before reading or writing anything, so results are those of the ordinary launch. After the
wait a kernel signals its own dependents (``griddepcontrol.launch_dependents``), so the next
PDL kernel of the chain can be scheduled during this one's last wave. Ordering stays
transitive: every PDL kernel waits for its predecessor, which waited for its own.

``MLORA_BASE_PDL`` (``1``, the default where supported; ``0``: ordinary launches) covers the
add + RMSNorm, RoPE + KV write, SiLU product and paged attention (and split-merge) kernels.
cuBLAS's GEMMs between them are launched by torch without the attribute and so start as
before. Supported: CUDA on compute capability >= 9 with a Triton that has ``launch_pdl``
(``mlora.kernels.triton_sgmv._pdl_supported``, which the LoRA expand uses the same way); never
under the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlora.batch.envknobs import env_choice
from mlora.kernels.triton_sgmv import _pdl_supported

BASE_PDL_ENV = "MLORA_BASE_PDL"


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """First statement of a base-path kernel: with ``USE_PDL``, wait for the predecessor grid
    (complete, memory visible), then let this kernel's own dependents be scheduled."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def base_pdl(device: torch.device) -> bool:
    """Whether base-path kernels on ``device`` launch with PDL (``MLORA_BASE_PDL``, default 1)."""
    return env_choice(BASE_PDL_ENV, ("0", "1"), "1") == "1" and _pdl_supported(torch.device(device))


def pdl_launch(device: torch.device) -> dict:
    """Extra launch arguments of a base-path kernel with a ``USE_PDL`` constexpr: the launch
    option and the flag, or nothing (the kernel's default: ordinary launch)."""
    return dict(launch_pdl=True, USE_PDL=True) if base_pdl(device) else {}
