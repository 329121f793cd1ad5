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

``--busy-gpu``: a decode-like load runs on the compute stream meanwhile (a
captured graph of 32 layers of an 8B model's GEMMs at 256 rows and its paged
decode attention over ~640-token contexts, replayed back to back by a thread),
as a running job does in ``bench residency`` (validation's kernel finds SMs
only between its kernels). Loads start at random points of the iterations
and the script reports the copy-stream time per load from the same events as
the run. ``--probe-variants`` times the loads once per way of launching the
word-stats kernel (``wordstats.PROGRAMS`` / ``UNROLL``: ``default``, ``pN``,
``uN``, ``pNuM``; ``plain``: the probe issued without the slot's prepared
buffers, ``storage.probe_landed`` per load, as before the twentieth session),
on the same GPU.

    PYTHONPATH=. python scripts/load_breakdown.py --loads 64
    PYTHONPATH=. python scripts/load_breakdown.py --loads 96 --busy-gpu --probe-variants default,p16u4,p32u4
"""

import argparse
import collections
import random
import re
import sys
import threading
import time

import torch

from mlora.batch.adapters import residency as residency_mod
from mlora.bench.batch import PRESETS
from mlora.batch.adapters.catalog import PinnedAdapter
from mlora.batch.gcpauses import PAUSES
from mlora.batch.model.lora import group_shapes
from mlora.batch.adapters.residency import bank as bank_mod
from mlora.batch.adapters.residency import manager as manager_mod
from mlora.batch.adapters.residency import storage as storage_mod
from mlora.kernels import wordstats

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
    ap.add_argument("--busy-gpu", action="store_true", help="a decode-like graph replayed on the compute stream meanwhile")
    ap.add_argument("--probe-variants", default="default",
                    help="comma-separated launches of the word-stats kernel: default, pN (N programs), uN (N blocks "
                         "per step), pNuM; plain: the probe issued per load without the slot's prepared buffers")
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
    prepared_probe = res.prober.probe
    res.prober.probe = lambda slot, views: (storage_mod.probe_landed(views, non_blocking=True) if PLAIN[0]
                                            else prepared_probe(slot, views))
    timed(res.prober, "probe", "probe enqueue (host, no sync)")  # kernel launch + read-backs issued
    stop = threading.Event()

    def busy():
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i * i

    threads = [threading.Thread(target=busy, daemon=True) for _ in range(args.busy_threads)]
    if args.busy_gpu:
        if dev.type != "cuda":
            raise SystemExit("--busy-gpu needs a GPU")
        threads.append(threading.Thread(target=busy_gpu, args=(p, stop), daemon=True))
    for t in threads:
        t.start()
    if args.busy_gpu:
        BUSY_READY.wait()
    nbytes = bank.residency.host.get(pinned["a0"].semantic_sha256).nbytes
    print(f"{dev}, {args.preset} q/v rank {r}: {nbytes / 1e6:.1f} MB per adapter, host build "
          f"{build * 1e3:.1f} ms (built before timing), {args.busy_threads} busy threads, GIL switch interval "
          f"{sys.getswitchinterval() * 1e3:g} ms{', busy GPU (decode-like graph, ' + f'{BUSY_MS[0]:.1f} ms per replay)' if args.busy_gpu else ''}")
    med = lambda v: sorted(v)[len(v) // 2] * 1e3  # noqa: E731
    pct = lambda v, q: sorted(v)[min(len(v) - 1, int(q * len(v)))] * 1e3  # noqa: E731
    rng = random.Random(0)
    for variant in args.probe_variants.split(","):
        PLAIN[0] = variant == "plain"
        m = re.fullmatch(r"(?:p(\d+))?(?:u(\d+))?", "" if variant in ("default", "plain") else variant)
        if m is None:
            raise SystemExit(f"--probe-variants: {variant!r} is not default, plain, pN, uN or pNuM")
        wordstats.PROGRAMS, wordstats.UNROLL = (int(m[1]) if m[1] else None), (int(m[2]) if m[2] else 1)
        TIMES.clear()
        st = bank.residency.stats
        for q in (st.load_device_seconds, st.load_copy_seconds, st.load_issue_seconds, st.load_issue_cpu_seconds,
                  st.load_issue_gc_seconds):
            q.clear()
        total = []
        PAUSES.install()  # the collector's pauses inside each load's issue (load_issue_gc_seconds)
        for a in pinned:
            if args.busy_gpu:
                time.sleep(rng.uniform(0, BUSY_MS[0] / 1e3))  # start at a random point of an iteration
            elif sync:
                sync()
            t0 = time.perf_counter()
            bank.ensure([a], pinned)
            if sync and not args.busy_gpu:
                sync()
            total.append(time.perf_counter() - t0)
        print(f"probe {variant} (programs {wordstats.PROGRAMS or 'one per chunk'}, {wordstats.UNROLL} blocks per step"
              f"{', issued per load without prepared buffers' if PLAIN[0] else ''}):")
        print(f"  {'ensure (one cold load)':34s} median {med(total):7.2f} ms")
        for k, v in TIMES.items():
            print(f"  {k:34s} median {med(v):7.2f} ms  ({len(v)} calls)")
        if st.load_device_seconds:  # event-timed on the copy stream, as bench residency reports them in a run
            v = st.load_device_seconds
            print(f"  {'copy stream (start to probe end)':34s} median {med(v):7.2f} ms, p90 {pct(v, 0.9):.2f}  "
                  f"(copies alone {med(st.load_copy_seconds):.2f} ms)")
        PAUSES.uninstall()
        if st.load_issue_seconds:  # as bench residency reports them: wall, the thread's CPU, collections inside
            w, c, g = st.load_issue_seconds, st.load_issue_cpu_seconds, st.load_issue_gc_seconds
            print(f"  {'host issue (wall / CPU)':34s} median {med(w):7.2f} / {med(c):.2f} ms, p90 {pct(w, 0.9):.2f} / "
                  f"{pct(c, 0.9):.2f}; collector pauses in {sum(1 for t in g if t > 0)} of {len(g)} issues, "
                  f"{sum(g) * 1e3:.2f} ms in all")
    stop.set()
    for t in threads:
        t.join(timeout=10)


PLAIN = [False]  # the "plain" variant: each probe allocated and issued per load (storage.probe_landed), as before
BUSY_READY = threading.Event()
BUSY_MS = [0.0]


def busy_gpu(p: dict, stop: threading.Event) -> None:
    """Replay a decode-like graph on this thread's own stream until ``stop``: per layer the
    q/k/v, o, gate/up and down GEMMs of 256 rows and a paged decode attention over contexts
    uniform in [128, 1152] (one cache for every layer, so each layer reads it from HBM)."""
    from mlora.kernels.paged_attention import PagedLayout, paged_attention

    torch.manual_seed(0)
    d, f = p["hidden_size"], p["intermediate_size"]
    H, Hkv, D, L = p["num_heads"], p["num_kv_heads"], p["head_dim"], p["num_layers"]
    rows, block = 256, 16
    bf = dict(dtype=torch.bfloat16, device="cuda")
    w_qkv, w_o = torch.randn(d, (H + 2 * Hkv) * D, **bf) / 64, torch.randn(H * D, d, **bf) / 64
    w_up, w_down = torch.randn(d, 2 * f, **bf) / 64, torch.randn(f, d, **bf) / 64
    lens_rng = random.Random(1)  # (the twentieth session's runs drew every length from a fresh generator: all 403)
    lens = [lens_rng.randint(128, 1152) for _ in range(rows)]
    tables, nxt = [], 0
    for n in lens:
        k = -(-n // block)
        tables.append(list(range(nxt, nxt + k)))
        nxt += k
    k_cache = torch.randn(nxt, block, Hkv, D, **bf)
    v_cache = torch.randn(nxt, block, Hkv, D, **bf)
    layout = PagedLayout.build(list(range(rows + 1)), lens, tables, H // Hkv, torch.device("cuda"))
    x = torch.randn(rows, d, **bf)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        def step():
            h = x
            for _ in range(L):
                qkv = h @ w_qkv
                att = paged_attention(qkv[:, : H * D].reshape(rows, H, D), k_cache, v_cache, layout, D**-0.5)
                h = att.reshape(rows, H * D) @ w_o
                up = h @ w_up
                h = up[:, :f] @ w_down
        step()  # compile, warm
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            step()
        graph.replay()
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            graph.replay()
        stream.synchronize()
        BUSY_MS[0] = (time.perf_counter() - t0) / 5 * 1e3
        BUSY_READY.set()
        # two replays queued at any time; waits poll an event with sleeps (stream.synchronize()
        # would hold the GIL for a whole replay and starve the loading thread: the first run of
        # this mode took 1.2 s per ensure)
        done = collections.deque()
        while not stop.is_set():
            graph.replay()
            ev = torch.cuda.Event()
            ev.record(stream)
            done.append(ev)
            while len(done) > 1:
                if done[0].query():
                    done.popleft()
                else:
                    time.sleep(0.0005)
        stream.synchronize()


if __name__ == "__main__":
    main()
