"""The stream-K GEMM (mlora.kernels.streamk, an experiment) against a float64 product.

On the CPU it runs under TRITON_INTERPRET=1 (set in conftest) at small shapes, where the
programs run one after another: the schedule's arithmetic (data-parallel tiles, runs that
cross tiles, the last run of a split tile storing it) is what these check; the concurrency
of the atomics is only exercised on a GPU.
"""

import pytest
import torch

from mlora.kernels.streamk import _workspaces, schedule, streamk_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "M, N, K, programs, mode, dtype",
    [
        (40, 96, 128, 4, "hybrid", torch.float32),  # 9 tiles on 4 programs: 8 whole, 1 split four ways
        (32, 64, 256, 5, "sk", torch.float32),  # every tile split; runs cross tile boundaries
        (33, 64, 192, 7, "hybrid", torch.bfloat16),  # M not a multiple of BM: wrapped loads, masked stores
        (48, 80, 64, 4, "dp", torch.float16),  # N not a multiple of BN, all tiles whole
        (16, 32, 320, 3, "hybrid", torch.float32),  # one tile, 10 iterations over 3 programs (4/3/3)
    ],
)
def test_streamk_matches_float64_product(M, N, K, programs, mode, dtype):
    g = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w = torch.randn(N, K, generator=g).to(DEVICE, dtype)
    ref = x.double() @ w.double().T
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    _, dp, sk_tiles, _ = schedule(M, N, K, 16, 32, 32, programs, mode)
    assert dp + sk_tiles == -(-M // 16) * -(-N // 32)
    for _ in range(3):  # the workspace and counters must be left zero for the next call
        out = torch.full((M, N), float("nan"), device=DEVICE, dtype=dtype)
        streamk_linear(x, w, out, bm=16, bn=32, bk=32, programs=programs, mode=mode)
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < tol, err
        ws, cnt = _workspaces[(x.device, 16, 32)]
        assert not ws.any() and not cnt.any()


@pytest.mark.skipif(DEVICE != "cuda", reason="tensor descriptors need a GPU (the interpreter path is above)")
@pytest.mark.parametrize("mode", ["hybrid", "sk", "dp"])
def test_streamk_tma_matches_float64_product(mode):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(200, 512, generator=g).to(DEVICE, torch.bfloat16)  # 200 rows: a partial row tile
    w = torch.randn(1000, 512, generator=g).to(DEVICE, torch.bfloat16)
    ref = x.double() @ w.double().T
    for _ in range(3):
        out = torch.full((200, 1000), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        streamk_linear(x, w, out, bm=64, bn=128, bk=64, programs=12, mode=mode, tma=True)
        assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2


def test_schedule_splits_the_last_wave():
    # the 8B gate/up at 256 rows, 128x256 tiles on 132 SMs: 224 tiles, one whole wave, 92 split
    assert schedule(256, 28672, 4096, 128, 256, 64, 132, "hybrid") == (2, 132, 92, 92 * 64)
    assert schedule(256, 28672, 4096, 128, 256, 64, 132, "dp") == (2, 224, 0, 0)
    assert schedule(256, 4096, 14336, 128, 128, 64, 132, "hybrid") == (2, 0, 64, 64 * 224)
    with pytest.raises(ValueError, match="mode"):
        schedule(1, 1, 64, 16, 16, 64, 1, "fast")


def test_streamk_refuses_what_it_cannot_run():
    x = torch.randn(4, 48)
    with pytest.raises(ValueError, match="multiple of bk"):
        streamk_linear(x, torch.randn(8, 48), bk=32)
    with pytest.raises(ValueError, match="one dtype"):
        streamk_linear(x, torch.randn(8, 48, dtype=torch.float64), bk=16)
