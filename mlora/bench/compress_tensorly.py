"""mlora's JD-Full / JD-Diag solvers against TensorLy's partial Tucker / PARAFAC on the same collections.

    python -m mlora.bench.compress_tensorly [--adapters 64,256,1024] [--dim 512] [--json]

JD-Full is a partial Tucker (Tucker-2: modes 1 and 2, the adapter mode kept)
of the adapter-stacked tensor ``T[i] = Delta_i / ||Delta_i||`` [n, d_out, d_in]
and JD-Diag a rank-R CP decomposition of it (factors ``D, U, V``; core i is
``diag(D[i])``). ``mlora`` fits the factored adapters (``B_i``, ``A_i``) with
:func:`mlora.compress.jd_full` / :func:`~mlora.compress.jd_diag`;
``tensorly`` forms the dense tensor (timed with the fit) and runs
``tensorly.decomposition.partial_tucker`` / ``parafac`` on the PyTorch
backend. All get the bundle's options (normalised, at most ``--iters``
sweeps from the HOSVD start, tolerance ``--tol``: TensorLy reads it as the
change in relative error, mlora as the relative change of the objective).

Errors are the bundle's metric for both: the squared relative Frobenius
error ``||Delta_i - U Sigma_i V^T||^2 / ||Delta_i||^2`` of every adapter,
computed exactly by :func:`mlora.compress.relative_errors`, mean and max.
``peak MiB`` is the rise of the process's peak resident set over the fit
(each case runs in a fresh subprocess, after the inputs exist); ``dense
MiB`` is the ``n x d_out x d_in`` tensor TensorLy needs. A TensorLy case
whose dense tensor times ``DENSE_OVERHEAD`` exceeds the available memory is
skipped and says so.

The collection (:func:`collection`): n rank-r adapters, each a weighted
sum of r of ``--shared`` common rank-one atoms plus noise, drawn from one
seed, so every implementation sees the same numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import subprocess
import sys
import time
import warnings

import tensorly as tl
import torch
from tensorly.decomposition import parafac, partial_tucker

from mlora.compress import (
    FactoredCollection,
    FactoredDelta,
    JDResult,
    jd_diag,
    jd_full,
    relative_errors,
)

IMPLS = ("mlora", "tensorly")
METHODS = ("jd-full", "jd-diag")
DTYPES = {"float32": torch.float32, "float64": torch.float64}
# Peak memory of a TensorLy fit over its dense tensor's size: about 4 for
# both partial Tucker and PARAFAC at n = 256, d = 512, as this module measures.
DENSE_OVERHEAD = 4


def collection(n: int, dim: int, rank: int, shared: int, noise: float, dtype: torch.dtype, seed: int = 0):
    """n factored adapters ``Delta_i = B_i A_i`` (``d_in = d_out = dim``), each r of ``shared`` common atoms plus noise.

    Atoms are ``u_j v_j^T`` (U0, V0 [dim, shared], orthonormal columns);
    adapter i takes r of them at random with its own weights,
    ``B_i = U0[:, S_i] diag(c_i) + E_B``, ``A_i = V0[:, S_i]^T + E_A``, the
    noise carrying ``noise``^2 of each factor's energy. JD-Full and JD-Diag
    of rank ``shared`` can both reach the noise floor.
    """
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    U0 = torch.linalg.qr(draw(dim, shared))[0]
    V0 = torch.linalg.qr(draw(dim, shared))[0]
    level = noise / math.sqrt(dim)  # a noise column or row then has energy noise^2, an atom's factor 1
    out = []
    for _ in range(n):
        atoms = torch.randperm(shared, generator=gen)[:rank]
        B = U0[:, atoms] * draw(rank) + level * draw(dim, rank)
        A = V0[:, atoms].T + level * draw(rank, dim)
        out.append(FactoredDelta(A=A.to(dtype), B=B.to(dtype), scale=1.0 / rank))
    return out


def dense_bytes(n: int, dim: int, dtype: torch.dtype) -> int:
    return n * dim * dim * torch.empty((), dtype=dtype).element_size()


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _dense(factors, dtype: torch.dtype) -> torch.Tensor:
    A = torch.stack([f.A for f in factors]).to(dtype)
    B = torch.stack([f.B * f.scale for f in factors]).to(dtype)
    return torch.bmm(B, A)  # [n, d_out, d_in]


def fit_tensorly(factors, method: str, R: int, iters: int, tol: float, dtype: torch.dtype):
    """TensorLy's fit of the normalised dense stack: (U, V, cores in original units, sweeps)."""
    T = _dense(factors, dtype)
    scale = torch.linalg.vector_norm(T, dim=(1, 2))
    T.div_(scale[:, None, None])
    # the backend is set for this fit only: TensorLy's backend is process-wide state
    with tl.backend_context("pytorch"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # R above a mode's size: TensorLy pads its SVD start
        if method == "jd-full":
            (core, (U, V)), errors = partial_tucker(T, [R, R], modes=[1, 2], n_iter_max=iters, tol=tol, init="svd")
            cores = core * scale[:, None, None]
        else:
            cp, errors = parafac(T, R, n_iter_max=iters, tol=tol, init="svd", return_errors=True)
            weights, (D, U, V) = cp
            cores = D * weights * scale[:, None]
    return U, V, cores, len(errors)


def run_case(
    impl: str,
    method: str,
    n: int,
    dim: int = 512,
    rank: int = 16,
    R: int = 64,
    shared: int = 64,
    noise: float = 0.1,
    iters: int = 10,
    tol: float = 1e-6,
    dtype: str = "float32",
    seed: int = 0,
) -> dict:
    """One fit: wall seconds, sweeps, peak memory rise and the per-adapter errors' mean and max."""
    factors = collection(n, dim, rank, shared, noise, DTYPES[dtype], seed)
    # reference norms for the error metric, outside the timed region
    norms = FactoredCollection(factors, 1, False, "cpu").norms
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if impl == "mlora":
        solver = jd_full if method == "jd-full" else jd_diag
        result = solver(factors, R, iters=iters, tol=tol, normalize=True, seed=seed)
        sweeps = result.iterations
    else:
        U, V, cores, sweeps = fit_tensorly(factors, method, R, iters, tol, DTYPES[dtype])
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    if impl == "tensorly":
        f64 = torch.float64
        result = JDResult(method, U.to(f64), V.to(f64), cores.to(f64), norms, True, sweeps, False, seed)
    errors = relative_errors(factors, result)
    return {
        "impl": impl,
        "method": method,
        "dtype": dtype,
        "n": n,
        "dim": dim,
        "seconds": seconds,
        "sweeps": sweeps,
        "peak_mib": peak / 1024,
        "dense_mib": dense_bytes(n, dim, DTYPES[dtype]) / 2**20,
        "err_mean": sum(errors) / len(errors),
        "err_max": max(errors),
    }


def measure(impl: str, method: str, n: int, threads: int = 1, repeats: int = 1, **options) -> dict:
    """:func:`run_case` in a fresh interpreter (its own peak memory); TensorLy skipped where the dense tensor cannot fit."""
    need = dense_bytes(n, options["dim"], DTYPES[options["dtype"]])
    if impl == "tensorly" and DENSE_OVERHEAD * need > available_bytes():
        return {
            "impl": impl, "method": method, "dtype": options["dtype"], "n": n, "dim": options["dim"],
            "dense_mib": need / 2**20,
            "skipped": f"dense tensor {need / 2**30:.1f} GiB x {DENSE_OVERHEAD} > {available_bytes() / 2**30:.1f} GiB available",
        }
    spec = json.dumps(dict(impl=impl, method=method, n=n, threads=threads, repeats=repeats, **options))
    done = subprocess.run(
        [sys.executable, "-m", "mlora.bench.compress_tensorly", "--case", spec],
        capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        return {"impl": impl, "method": method, "dtype": options["dtype"], "n": n, "dim": options["dim"],
                "dense_mib": need / 2**20, "failed": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cells(group, key: str, fmt: str) -> str:
    return " / ".join(fmt.format(r[key]) if "seconds" in r else "-" for r in group)


def table(rows) -> str:
    """Markdown, one row per (n, method, impl): seconds, sweeps and memory per dtype, errors of the first dtype."""
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["n"], r["method"], r["impl"]), []).append(r)
    dtypes = " / ".join(dict.fromkeys(r["dtype"] for r in rows))
    first = rows[0]["dtype"] if rows else ""
    head = (
        f"| n | method | impl | seconds ({dtypes}) | sweeps | peak MiB ({dtypes}) | dense MiB ({dtypes})"
        f" | err mean ({first}) | err max ({first}) |"
    )
    lines = [head, "|" + "---|" * 9]
    for (n, method, impl), group in groups.items():
        dense = " / ".join(f"{r.get('dense_mib', 0):.0f}" for r in group) if impl == "tensorly" else "-"
        done = [r for r in group if "seconds" in r]
        if not done:
            why = group[0].get("skipped") or group[0].get("failed")
            lines.append(f"| {n} | {method} | {impl} | {why} | | | {dense} | | |")
            continue
        lines.append(
            f"| {n} | {method} | {impl} | {_cells(group, 'seconds', '{:.1f}')} | {_cells(group, 'sweeps', '{}')}"
            f" | {_cells(group, 'peak_mib', '{:.0f}')} | {dense} | {done[0]['err_mean']:.4f} | {done[0]['err_max']:.4f} |"
        )
    return "\n".join(lines)


def header(meta) -> str:
    return (
        f"CPU {meta['cpu']}, {meta['threads']} torch thread(s), best of {meta['repeats']},"
        f" torch {meta['torch']}, tensorly {meta['tensorly']}\noptions {meta['options']}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlora.bench.compress_tensorly", description=__doc__.split("\n")[0])
    p.add_argument("--adapters", default="64,256,1024", help="collection sizes n, comma-separated")
    p.add_argument("--dim", type=int, default=512, help="d_in = d_out")
    p.add_argument("--rank", type=int, default=16, help="every adapter's rank r")
    p.add_argument("--shared-rank", type=int, default=64, help="R, the bases' rank")
    p.add_argument("--shared", type=int, default=64, help="dimension of the adapters' common subspace")
    p.add_argument("--noise", type=float, default=0.1)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tol", type=float, default=1e-6)
    p.add_argument("--dtypes", default="float32,float64", help="input dtypes (mlora always fits in float64)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--repeats", type=int, default=1, help="timed fits per case; the fastest counts")
    p.add_argument("--json", action="store_true")
    p.add_argument("--render", metavar="FILE", help="print the table of a saved --json report and exit")
    p.add_argument("--case", help=argparse.SUPPRESS)  # one run_case in this process, as JSON
    a = p.parse_args(argv)
    if a.render:
        with open(a.render) as f:
            report = json.load(f)
        print(header(report["meta"]))
        print(table(report["rows"]))
        return 0
    if a.case:
        spec = json.loads(a.case)
        threads = spec.pop("threads", 0)
        if threads:
            torch.set_num_threads(threads)
        # first calls load LAPACK and TensorLy's backend: pay that before the timed fit
        run_case(spec["impl"], spec["method"], 4, dim=32, rank=2, R=4, shared=4, iters=2, dtype=spec["dtype"])
        repeats = spec.pop("repeats", 1)
        runs = [run_case(**spec) for _ in range(max(1, repeats))]
        best = min(runs, key=lambda r: r["seconds"])
        best["peak_mib"] = max(r["peak_mib"] for r in runs)
        print(json.dumps(best))
        return 0
    if a.threads:
        torch.set_num_threads(a.threads)
    options = {"threads": a.threads, "repeats": a.repeats, "dim": a.dim, "rank": a.rank, "R": a.shared_rank,
               "shared": a.shared, "noise": a.noise, "iters": a.iters, "tol": a.tol, "seed": a.seed}
    rows = []
    for n in (int(x) for x in a.adapters.split(",")):
        for method in a.methods.split(","):
            for dtype in a.dtypes.split(","):
                for impl in a.impls.split(","):
                    row = measure(impl, method, n, dtype=dtype, **options)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    meta = {"cpu": cpu_model(), "threads": a.threads or torch.get_num_threads(), "repeats": a.repeats,
            "torch": torch.__version__, "tensorly": tl.__version__, "options": options}
    if a.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=1))
    else:
        print(header(meta))
        print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
