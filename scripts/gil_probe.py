"""How long an adapter host-image build holds the interpreter lock, stage by stage (CPU).

The engine thread issues a cold load (a dozen CUDA calls, each releasing and
re-taking the interpreter lock) while prefetch threads build the next
adapters' host images. Whenever a builder holds the lock in one long C call
(a large copy into a ``bytes`` object, a numpy operation that keeps the
lock), the engine thread waits for it after its switch interval: the tail of
``load_issue_ms`` in the 8,000-row residency job (twenty-first session: p90
2.3 ms wall against 1.0 ms of CPU time). This script needs no GPU: it writes
real adapter files of a preset's q/v shape, pins them as a job does, and
builds their host images with the bank's own code on the main thread while a
probe thread sleeps 50 us at a time and records how late each wake-up comes
(a wake-up needs the lock). Per build stage it prints the lateness
distribution beside the idle one and a pure-Python loop's (which gives the
lock up only at each switch interval): a stage that holds the lock in long C
calls shows late wake-ups well above idle. Maxima are not printed: on a
shared two-core VM the idle maximum alone reached 1.2 ms (scheduler noise).

    PYTHONPATH=. python scripts/gil_probe.py [--preset llama-3-8b] [--builds 8]
"""

import argparse
import os
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mlora.batch.adapters import catalog as catalog_mod  # noqa: E402
from mlora.bench.batch import PRESETS  # noqa: E402
from mlora.bench.residency import write_adapter  # noqa: E402
from mlora.batch.model.lora import group_shapes  # noqa: E402
from mlora.batch.adapters.residency import bank as bank_mod  # noqa: E402
from mlora.batch.adapters.residency import host as host_mod  # noqa: E402
from mlora.batch.adapters.residency.pinned import PinnedPool  # noqa: E402
from mlora.lora_tools.adapter import open_adapter, scan_adapters  # noqa: E402
from mlora.lora_tools.base import BaseIdentity  # noqa: E402

TICK_S = 50e-6


class Probe:
    """A thread that sleeps ``TICK_S`` again and again and records each wake-up's lateness
    (beyond the tick) with its time; ``between(t0, t1)`` sums and maxes those in a window."""

    def __init__(self):
        self.marks: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(TICK_S)
            t1 = time.perf_counter()
            self.marks.append((t1, t1 - t0 - TICK_S))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def between(self, t0: float, t1: float) -> list[float]:
        """Lateness of every wake-up whose wait overlapped [t0, t1]."""
        # a wake-up at t, d late, waited over [t - d - tick, t]
        return [d for t, d in self.marks if t >= t0 and t - d - TICK_S <= t1]


def summary(late: list[float]) -> str:
    late = sorted(late)
    if not late:
        return "no wake-ups"
    n = len(late)
    return (f"{n} wake-ups, late p50 {1e3 * late[n // 2]:.3f} p90 {1e3 * late[int(0.9 * (n - 1))]:.3f} "
            f"p99 {1e3 * late[int(0.99 * (n - 1))]:.3f} ms")


def pinned_adapters(root: str, preset: str, n: int, rank: int) -> list:
    """``n`` q/v adapters of ``preset`` written under ``root`` and pinned as a job pins them
    (a placeholder base identity: the base is never read here)."""
    base = BaseIdentity(*(f"{i:064x}" for i in range(5)))
    out = []
    for k in range(n):
        path = os.path.join(root, f"a{k:02d}")
        write_adapter(path, preset, rank, ("q_proj", "v_proj"), 1000 + k, torch.bfloat16)
        art = open_adapter(path, allow_pickle=False)
        scan_adapters([art], 1)
        entry = catalog_mod.CatalogEntry(f"a{k:02d}", path)
        pinned = catalog_mod._pin_one(entry, art, base)
        if not pinned.ok:
            raise SystemExit(f"pinning failed: {pinned.error_code} {pinned.error_message}")
        out.append(pinned)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3-8b")
    ap.add_argument("--builds", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--switch-interval-us", type=int, default=500, help="the job's (session.SWITCH_INTERVAL_US)")
    args = ap.parse_args()
    sys.setswitchinterval(args.switch_interval_us / 1e6)
    # one intra-op thread: the probe needs a free core, or it measures CPU contention, not the lock
    torch.set_num_threads(args.torch_threads)
    p = PRESETS[args.preset]
    shapes = group_shapes(p["hidden_size"], p["intermediate_size"], p["num_heads"], p["num_kv_heads"], p["head_dim"])
    bank = bank_mod.ResidencyBank(p["num_layers"], {"qkv": shapes["qkv"]}, 2, args.rank, torch.bfloat16, "cpu",
                                  prefetch_workers=0, slices={"qkv": (0, 2)})
    layout = bank.layout
    stages = {}

    def timed(owner, name: str, label: str):
        fn = getattr(owner, name)

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                stages.setdefault(label, []).append((t0, time.perf_counter()))
        setattr(owner, name, wrapper)

    timed(catalog_mod, "_read_verified", "read + re-hash one tensor (pread, sha256, bytearray)")
    bank_mod.load_factors = catalog_mod.load_factors  # the bank's name for it, so the wrapper below is seen
    timed(bank_mod, "load_factors", "load_factors (all tensors)")
    timed(layout, "_place", "place factors")
    timed(layout, "whole_views", "whole views (zeros, then the pieces)")
    timed(host_mod.HostArtifact, "view_checks", "view checks (numpy word stats)")
    with tempfile.TemporaryDirectory() as root:
        adapters = pinned_adapters(root, args.preset, args.builds, args.rank)
        # blocks of ordinary memory (this machine may have no CUDA), given back as the images go
        pool = PinnedPool(layout.max_image_bytes(), 4, pin=False)
        layout.artifact(adapters[0])  # warm-up (imports, caches), not measured
        stages.clear()
        builds = []
        with Probe() as probe:
            t0 = time.perf_counter()
            time.sleep(0.5)
            idle = probe.between(t0, time.perf_counter())
            t0, x = time.perf_counter(), 0
            while time.perf_counter() - t0 < 0.5:
                x += 1
            loop = probe.between(t0, time.perf_counter())
            for a in adapters:
                t0 = time.perf_counter()
                art = layout.artifact(a)
                t1 = time.perf_counter()
                c0 = time.perf_counter()
                art.pinned(pool)  # what a prefetch thread does next: the image into a pool block
                builds.append((t0, t1, c0, time.perf_counter()))
    print(f"{args.preset} q/v rank {args.rank}: {args.builds} builds of {1e3 * sum(t1 - t0 for t0, t1, _, _ in builds) / len(builds):.1f} ms, "
          f"probe tick {TICK_S * 1e6:.0f} us, switch interval {sys.getswitchinterval() * 1e3:g} ms")
    print(f"  idle (no build):      {summary(idle)}")
    print(f"  Python loop (holds the lock between switches): {summary(loop)}")
    print(f"  whole builds:         {summary([d for t0, t1, _, _ in builds for d in probe.between(t0, t1)])}")
    print(f"  copy into pool block: {summary([d for _, _, c0, c1 in builds for d in probe.between(c0, c1)])}")
    for label, spans in stages.items():
        print(f"  {label} ({len(spans) / len(builds):g} per build, "
              f"{1e3 * sum(t1 - t0 for t0, t1 in spans) / len(builds):.2f} ms per build): "
              f"{summary([d for t0, t1 in spans for d in probe.between(t0, t1)])}")

if __name__ == "__main__":
    main()
