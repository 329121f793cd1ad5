"""``mlora bench startup``: a checkpoint to the GPU and its first token, against the disk.

Start-up of a batch job is reading the checkpoint, moving it to the device and
running the first prompt. The floor is the checkpoint's bytes over the disk's
read bandwidth, measured in the same run: every safetensors file of the base
is written back and dropped from the page cache (``posix_fadvise``
``DONTNEED``, no privileges needed), read once in 16 MiB blocks (the cold read
bandwidth), dropped again, then loaded by ``DecoderModel.from_pretrained``
onto the device and one 16-token prompt is run to its first generated token
through the engine (no CUDA graphs). The target is
1.5 x floor + 10 s. ``cache_dropped`` says whether the kernel accepted the
advice for every file (when it did not, the "cold" figures are warm ones).
Without ``BASE`` a random checkpoint of ``--preset`` is written into
``WORKDIR/base`` first (reused if present).
"""

from __future__ import annotations

import glob
import os
import time

import torch

READ_BLOCK = 16 << 20


def checkpoint_files(base: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(base, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {base}")
    return files


def drop_cache(files: list[str]) -> bool:
    """Write back and drop ``files`` from the page cache; False where the kernel refused."""
    ok = True
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            ok = False
        finally:
            os.close(fd)
    return ok


def read_bandwidth(files: list[str]) -> tuple[int, float]:
    """(bytes, seconds) to read every file once, sequentially."""
    buf = bytearray(READ_BLOCK)
    total, t0 = 0, time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                total += n
    return total, time.perf_counter() - t0


def run_startup_bench(base: str, device: str = "cuda", dtype: str = "bfloat16") -> dict:
    from mlora.batch.config import EngineConfig
    from mlora.batch.engine.engine import Engine, Request
    from mlora.batch.model.decoder import DTYPES, DecoderModel

    dev, dt = torch.device(device), DTYPES[dtype]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    files = checkpoint_files(base)
    dropped = drop_cache(files)
    nbytes, read_s = read_bandwidth(files)
    dropped = drop_cache(files) and dropped
    t0 = time.perf_counter()
    model = DecoderModel.from_pretrained(base, device=dev, dtype=dt)
    sync()
    load_s = time.perf_counter() - t0
    eng = Engine(model, None, {}, EngineConfig(max_num_seqs=1, max_batch_tokens=64, cuda_graphs=False, lookahead=False), num_blocks=4)
    eng.add(Request(0, "0", list(range(1, 17)), None, 1))
    out = eng.drain()
    sync()
    first_s = time.perf_counter() - t0
    if len(out) != 1 or out[0].finish_reason == "error":
        raise RuntimeError(f"the first-token request did not finish: {out}")
    floor_s = read_s  # the whole checkpoint once at the measured cold bandwidth
    return dict(base=os.path.abspath(base), device=str(dev), dtype=dtype, checkpoint_bytes=nbytes,
                cache_dropped=dropped, read_s=read_s, read_bytes_per_s=nbytes / read_s if read_s else None,
                load_s=load_s, first_token_s=first_s, floor_s=floor_s, target_s=1.5 * floor_s + 10.0,
                met=first_s <= 1.5 * floor_s + 10.0,
                gpu=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu")
