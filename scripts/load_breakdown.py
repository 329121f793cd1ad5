"""Where one adapter load of the residency bank spends its time (no model, no files).

Builds a ResidencyBank with the q/v slots of a shape preset (llama-3-8b: the
adapters of ``mlora bench residency``), feeds it synthetic host images of the
same layout (random factors, built and pinned up front: the host tier is
warm), and loads ``--loads`` adapters one at a time through ``ensure`` with
the device otherwise idle, timing the stages of each load: host image lookup,
the host-side layout check, the copy issue (H2D of the whole-view image, or zero + pieces), the wait for
the copy, and validation of what landed. ``--busy-threads N`` runs N threads
doing GIL-holding Python work meanwhile (what the prefetch builders do to the
engine thread).

    PYTHONPATH=. python scripts/load_breakdown.py --loads 64
"""

import argparse
import collections
import sys
import threading
import time

import torch

from mlora.batch import residency as residency_mod
from mlora.batch.bench import PRESETS
from mlora.batch.catalog import PinnedAdapter
from mlora.batch.lora import group_shapes
from mlora.batch.residency import bank as bank_mod
from mlora.batch.residency import manager as manager_mod
from mlora.batch.residency import storage as storage_mod

TIMES: dict[str, list[float]] = collections.defaultdict(list)


def timed(owner, name: str, label: str, sync=None):
    fn = getattr(owner, name)

    def run(*a, **k):
        if sync:
            sync()
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            if sync:
                sync()
            TIMES[label].append(time.perf_counter() - t0)

    setattr(owner, name, run)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3-8b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--loads", type=int, default=64)
    ap.add_argument("--busy-threads", type=int, default=0)
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="sys.setswitchinterval for the run (batch-run sets 0.5 while prefetch threads run)")
    args = ap.parse_args()
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    p = PRESETS[args.preset]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = group_shapes(p["hidden_size"], p["intermediate_size"], p["num_heads"], p["num_kv_heads"], p["head_dim"])
    qkv = {"qkv": shapes["qkv"]}
    L, r = p["num_layers"], args.rank
    d_in, (q_out, _, v_out) = qkv["qkv"]
    gen = torch.Generator().manual_seed(0)
    factors = {}
    for layer in range(L):
        for role, out in (("q_proj", q_out), ("v_proj", v_out)):
            factors[(layer, role)] = ((torch.randn(r, d_in, generator=gen) / 64).to(torch.bfloat16),
                                      (torch.randn(out, r, generator=gen) / 64).to(torch.bfloat16), 2.0)
    # q and v slices only, as batch-run's bank for q/v adapters (session.py): no k zeros copied
    bank = residency_mod.ResidencyBank(L, qkv, args.slots, r, torch.bfloat16, dev, prefetch_workers=0,
                                       slices={"qkv": (0, 2)})
    bank_mod.load_factors = lambda pinned, dtype, device: factors  # the same bytes for every adapter: no file
    pinned = {f"a{i}": PinnedAdapter(f"a{i}", None, True, artifact_sha256=f"{i:064x}", semantic_sha256=f"{i:064x}",
                                     max_rank=r) for i in range(args.loads)}
    host = bank.residency.host
    t0 = time.perf_counter()
    for a, pa in pinned.items():  # warm host tier: built and pinned before any load is timed
        host.register(pa.semantic_sha256, pa.semantic_sha256, lambda pa=pa: bank._artifact(pa))
        host.get(pa.semantic_sha256)
    build = (time.perf_counter() - t0) / len(pinned)
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    res = bank.residency
    timed(res.host, "get", "host image lookup")
    timed(res.storage, "check_artifact", "layout check (host)")
    timed(res, "_copy", "copy issue (zero + H2D)")
    timed(storage_mod, "validate_landed", "validate landed")
    manager_mod.validate_landed = storage_mod.validate_landed
    timed(res, "wait", "wait (copy + validate + publish)")
    timed(manager_mod, "probe_landed", "probe enqueue (host, no sync)")  # kernel launch + read-backs issued
    stop = threading.Event()

    def busy():
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i * i

    threads = [threading.Thread(target=busy, daemon=True) for _ in range(args.busy_threads)]
    for t in threads:
        t.start()
    total = []
    for a in pinned:
        if sync:
            sync()
        t0 = time.perf_counter()
        bank.ensure([a], pinned)
        if sync:
            sync()
        total.append(time.perf_counter() - t0)
    stop.set()
    nbytes = bank.residency.host.get(pinned["a0"].semantic_sha256).nbytes
    print(f"{dev}, {args.preset} q/v rank {r}: {nbytes / 1e6:.1f} MB per adapter, host build "
          f"{build * 1e3:.1f} ms (built before timing), {args.busy_threads} busy threads, GIL switch interval "
          f"{sys.getswitchinterval() * 1e3:g} ms")
    med = lambda v: sorted(v)[len(v) // 2] * 1e3  # noqa: E731
    print(f"  {'ensure (one cold load)':34s} median {med(total):7.2f} ms")
    for k, v in TIMES.items():
        print(f"  {k:34s} median {med(v):7.2f} ms  ({len(v)} calls)")
    st = bank.residency.stats  # event-timed on the copy stream, as bench residency reports them in a run
    if st.load_device_seconds:
        print(f"  {'copy stream (start to probe end)':34s} median {med(st.load_device_seconds):7.2f} ms  "
              f"(copies alone {med(st.load_copy_seconds):.2f} ms; an idle GPU: compare the run's p50)")


if __name__ == "__main__":
    main()
