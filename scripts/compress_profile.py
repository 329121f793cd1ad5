"""Where one module's clustered compression fit spends its time (step 5; BENCHMARKS.md).

    python scripts/compress_profile.py N D_OUT D_IN R K [--device cpu|cuda]

Builds N synthetic rank-16 adapters of one module (updates mostly in a shared
rank-48 subspace plus 5% noise, as examples/make_compress_bench_data.py),
runs ``mlora.compress.cluster.cluster`` (JD-Full, rank R, K clusters) and
prints calls and wall seconds per part (k-means, the joint and cluster
fits, QR, eigh, orthonormalisation, factored norms, Krylov eigenspaces,
exact errors). Parts nest (a jd_full row includes its eigensolver's rows).
Counting wrappers only; the fit is unchanged. On CUDA every wrapper
synchronises before and after its call, so asynchronous work is charged
to the part that launched it (and the total includes those waits).
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
def sync():
    if device.startswith("cuda"):
        torch.cuda.synchronize()  # async kernels are charged to the part that launched them
def timed(key, f):
    def w(*a, **kw):
        sync(); t = time.perf_counter(); out = f(*a, **kw); sync()
        s = stats[key]; s[0] += 1; s[1] += time.perf_counter() - t; return out
    return w
def wrap(mod, name, key=None):
    setattr(mod, name, timed(key or name, getattr(mod, name)))
for nm in ["qr", "eigh", "pinv", "cholesky_ex"]:
    wrap(torch.linalg, nm, "linalg." + nm)
wrap(cl, "kmeans"); wrap(cl, "relative_errors")
for nm in ["orthonormal_columns", "_factored_norms", "_small_product", "_leading_subspace", "_reduce"]:
    wrap(solvers, nm)  # _small_product: the QR fallback of _factored_norms
for nm in ["__init__", "best_core_errors"]:
    setattr(solvers.FactoredCollection, nm, timed("FactoredCollection" if nm == "__init__" else nm,
                                                   getattr(solvers.FactoredCollection, nm)))
fitn = collections.Counter()
for nm in ["jd_full"]:
    f = cl._SOLVERS["jd-full"]
    def w(factors, R_, **kw):
        sync(); t = time.perf_counter(); o = f(factors, R_, **kw); sync(); s = stats[f"jd_full R={R_}"]; s[0] += 1; s[1] += time.perf_counter() - t
        fitn[(len(factors) // 50) * 50] += 1; stats["sweeps"][0] += o.iterations; return o
    cl._SOLVERS["jd-full"] = w
sync(); t = time.perf_counter()
res = cl.cluster(fs, R, K, "jd-full", seed=0, device=device)
sync()
print(f"n={n} {d_out}x{d_in} R={R} K={K}: {time.perf_counter()-t:.1f} s, rounds {res.rounds}, worst {max(res.errors):.4f}, K {res.K}")
for k_, (c, s) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
    print(f"  {k_:24s} {c:6d} calls {s:8.2f} s")
print("fit sizes", sorted(fitn.items()))
