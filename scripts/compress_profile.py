"""Where one module's clustered compression fit spends its time (step 5; BENCHMARKS.md).

    python scripts/compress_profile.py N D_OUT D_IN R K [--device cpu|cuda]

Builds N synthetic rank-16 adapters of one module (updates mostly in a shared
rank-48 subspace plus 5% noise, as examples/make_compress_bench_data.py),
runs ``mlora.compress.cluster.cluster`` (JD-Full, rank R, K clusters) and
prints calls and wall seconds per part (k-means, the joint and cluster
fits, QR, eigh, exact errors). Counting wrappers only; the fit is unchanged.
"""
import collections
import importlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
solvers = importlib.import_module("mlora.compress.solvers")
cl = importlib.import_module("mlora.compress.cluster")
from mlora.compress.solvers import FactoredDelta
n, d_out, d_in, R, K = (int(a) for a in sys.argv[1:6])
device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
g = torch.Generator().manual_seed(0)
k, r = 48, 16
U0, V0 = torch.randn(d_out, k, generator=g), torch.randn(d_in, k, generator=g)
fs = []
for i in range(n):
    b = U0 @ torch.randn(k, r, generator=g) / k ** 0.5
    a = torch.randn(r, k, generator=g) @ V0.T / k ** 0.5
    b += 0.05 * b.std() * torch.randn(d_out, r, generator=g)
    a += 0.05 * a.std() * torch.randn(r, d_in, generator=g)
    fs.append(FactoredDelta((a * 0.01).bfloat16().double().to(device), (b * 0.01).bfloat16().double().to(device), 2.0))
stats = collections.defaultdict(lambda: [0, 0.0])
def wrap(mod, name, key=None):
    f = getattr(mod, name)
    def w(*a, **kw):
        t = time.perf_counter(); out = f(*a, **kw); s = stats[key or name]; s[0] += 1; s[1] += time.perf_counter() - t; return out
    setattr(mod, name, w)
for nm in ["qr", "eigh", "pinv"]:
    wrap(torch.linalg, nm, "linalg." + nm)
wrap(cl, "kmeans"); wrap(cl, "relative_errors", "relative_errors")
orig_init = solvers.FactoredCollection.__init__
def init(self, *a, **kw):
    t = time.perf_counter(); orig_init(self, *a, **kw); s = stats["FactoredCollection"]; s[0] += 1; s[1] += time.perf_counter() - t
solvers.FactoredCollection.__init__ = init
orig_bce = solvers.FactoredCollection.best_core_errors
def bce(self, *a, **kw):
    t = time.perf_counter(); o = orig_bce(self, *a, **kw); s = stats["best_core_errors"]; s[0] += 1; s[1] += time.perf_counter() - t; return o
solvers.FactoredCollection.best_core_errors = bce
fitn = collections.Counter()
for nm in ["jd_full"]:
    f = cl._SOLVERS["jd-full"]
    def w(factors, R_, **kw):
        t = time.perf_counter(); o = f(factors, R_, **kw); s = stats[f"jd_full R={R_}"]; s[0] += 1; s[1] += time.perf_counter() - t
        fitn[(len(factors) // 50) * 50] += 1; stats["sweeps"][0] += o.iterations; return o
    cl._SOLVERS["jd-full"] = w
t = time.perf_counter()
res = cl.cluster(fs, R, K, "jd-full", seed=0, device=device)
print(f"n={n} {d_out}x{d_in} R={R} K={K}: {time.perf_counter()-t:.1f} s, rounds {res.rounds}, worst {max(res.errors):.4f}, K {res.K}")
for k_, (c, s) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
    print(f"  {k_:24s} {c:6d} calls {s:8.2f} s")
print("fit sizes", sorted(fitn.items()))
