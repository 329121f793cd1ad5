"""Clustered joint decomposition: k clusters, each with its own shared bases (docs/compress.md, The command).

Owns the assignment of adapters to clusters at one module and the
alternation that improves it; the per-cluster fits are :func:`jd_full` /
:func:`jd_diag` from ``.solvers``. Knows nothing of bundles or serving.

    init:    one joint fit of every adapter, k-means on its cores
    fit:     refit each cluster's JD model on its members (warm-started
             from the cluster's previous bases)
    assign:  move each adapter to the cluster whose bases reconstruct it
             with the lowest error (its least-squares core under them)
    stop:    no assignment changes, or ``rounds`` alternations

Warm-started refits and lowest-error reassignment make the summed fitted
objective non-increasing, except where an emptied cluster is reseeded with
the adapter worst reconstructed by its own cluster. Deterministic under
``seed``: k-means++ draws come from a CPU ``torch.Generator``, ties break
towards the lower index, and cluster ids are numbered by their first member.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mlora.compress.solvers import (
    METHODS,
    CompressError,
    FactoredCollection,
    JDResult,
    check_factors,
    jd_diag,
    jd_full,
    relative_errors,
)

# An adapter changes cluster only when that lowers its relative error by more
# than this: ties at round-off must not make the alternation cycle.
_SWITCH_MARGIN = 1e-10

_SOLVERS = {"jd-full": jd_full, "jd-diag": jd_diag}


@dataclass
class ClusterResult:
    """k cluster fits of one module's collection.

    ``fits[c]`` is cluster c's JD model over ``members[c]`` (adapter indices,
    ascending; its cores are in that order). ``errors`` are the exact squared
    relative errors per adapter; ``objective`` the summed fitted objective
    after each round.
    """

    method: str
    R: int
    assignments: list[int]
    members: list[list[int]]
    fits: list[JDResult]
    errors: list[float]
    rounds: int
    converged: bool
    seed: int
    objective: list[float] = field(default_factory=list)

    @property
    def K(self) -> int:
        return len(self.fits)

    def bases(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(U, V)`` of adapter i's cluster."""
        fit = self.fits[self.assignments[i]]
        return fit.U, fit.V

    def core(self, i: int) -> torch.Tensor:
        """Adapter i's core (norms restored): [R, R] for JD-Full, [R] for JD-Diag."""
        c = self.assignments[i]
        return self.fits[c].cores[self.members[c].index(i)]


def kmeans(points: torch.Tensor, K: int, *, seed: int = 0, iters: int = 100, n_init: int = 4) -> list[int]:
    """Lloyd's k-means with k-means++ seeding; the labelling of lowest inertia over ``n_init`` seedings.

    Deterministic under ``seed`` on a given device (the random draws come
    from a CPU generator; distances are computed on the points' device, so a
    near-tie may break differently on another device); every cluster keeps at
    least one point (an empty cluster takes the point farthest from its
    centre among clusters of two or more). Requires ``1 <= K <= len(points)``.

    Points of more dimensions than there are points (JD-Full cores of a
    joint rank-512 start are 262,144-dimensional) are first rewritten in
    coordinates of their own span (:func:`span_coordinates`): every distance
    and every centre is the same up to round-off, at n dimensions instead of
    R^2.
    """
    X = points.detach().to(dtype=torch.float64).reshape(points.shape[0], -1)
    n = X.shape[0]
    if not 1 <= K <= n:
        raise CompressError("E_COMPRESS_CLUSTERS", f"k-means needs 1 <= K <= {n} points, got K={K}")
    if X.shape[1] > n:
        X = span_coordinates(X)
    gen = torch.Generator().manual_seed(seed)
    best_inertia, best = None, None
    rows = torch.arange(n, device=X.device)
    for _ in range(n_init):
        centers = _plusplus(X, K, gen)
        labels = None
        for _ in range(iters):
            dist = torch.cdist(X, centers).square()
            new = _fill_empty(dist.argmin(dim=1), dist, K)
            if labels is not None and torch.equal(new, labels):
                break
            labels = new
            centers = torch.stack([X[labels == k].mean(dim=0) for k in range(K)])
        inertia = float(torch.cdist(X, centers).square()[rows, labels].sum())
        if best_inertia is None or inertia < best_inertia:
            best_inertia, best = inertia, labels
    return best.tolist()


def span_coordinates(X: torch.Tensor) -> torch.Tensor:
    """Coordinates [n, n] of the rows of ``X`` [n, d] (d > n) in an orthonormal basis of their span.

    ``X^T = Q T`` (reduced QR, Q [d, n] orthonormal) gives ``X = T^T Q^T``:
    the rows of ``T^T`` are the points in the basis Q, so every Euclidean
    distance, mean and inertia is unchanged (up to round-off).
    """
    _, T = torch.linalg.qr(X.T, mode="reduced")
    return T.T.contiguous()


def _plusplus(X: torch.Tensor, K: int, gen: torch.Generator) -> torch.Tensor:
    n = X.shape[0]
    chosen = [int(torch.randint(n, (1,), generator=gen))]
    for _ in range(1, K):
        d2 = torch.cdist(X, X[chosen]).square().min(dim=1).values.cpu()  # the draw is on the CPU generator
        d2[chosen] = 0.0
        if float(d2.sum()) > 0:
            chosen.append(int(torch.multinomial(d2, 1, generator=gen)))
        else:  # every remaining point coincides with a centre
            rest = [i for i in range(n) if i not in chosen]
            chosen.append(rest[int(torch.randint(len(rest), (1,), generator=gen))])
    return X[chosen].clone()


def _fill_empty(labels: torch.Tensor, cost: torch.Tensor, K: int) -> torch.Tensor:
    """Give every empty cluster the point of highest cost among clusters that can spare one."""
    labels = labels.clone()
    for k in range(K):
        if bool((labels == k).any()):
            continue
        counts = torch.bincount(labels, minlength=K)
        own = cost[torch.arange(len(labels), device=labels.device), labels].clone()
        own[counts[labels] < 2] = -1.0
        labels[int(own.argmax())] = k
    return labels


def cluster(
    factors,
    R: int,
    K: int,
    method: str = "jd-full",
    *,
    seed: int = 0,
    iters: int = 10,
    tol: float = 1e-6,
    normalize: bool = True,
    rounds: int = 10,
    init_rank: int | None = None,
    solver_options: dict | None = None,
    device="cpu",
) -> ClusterResult:
    """Fit K clusters of shared rank R over one module's collection (module docstring).

    The initial assignment is k-means on the cores of one joint fit of rank
    ``init_rank`` (for JD-Full at most ``min(d_in, d_out)``), the cores taken
    in the fitted (normalised) units. Without ``init_rank`` (and K > 1) two
    starts are run, joint ranks R and K * R (the union of K rank-R cluster
    subspaces), and the result with the lower final objective is kept: either
    start alone can settle in a mis-grouped local minimum that the other
    avoids. ``iters``, ``tol``,
    ``normalize``, ``seed``, ``device`` and ``solver_options`` (e.g.
    ``{"eigensolver": "krylov"}`` for JD-Full, ``{"restarts": 2}`` for
    JD-Diag) go to every fit. K = 1 is one joint fit.

    The alternation of assignment and refit in one loop, kept whole so its stopping rule reads in one place.
    """
    if method not in METHODS:
        raise CompressError("E_COMPRESS_METHOD", f"method must be one of {METHODS}, got {method!r}")
    check_factors(factors)
    n = len(factors)
    if not 1 <= K <= n:
        raise CompressError("E_COMPRESS_CLUSTERS", f"need 1 <= clusters <= {n} adapters, got {K}")
    if init_rank is None and K > 1:
        starts = list(dict.fromkeys((R, K * R)))
        results = [cluster(factors, R, K, method, seed=seed, iters=iters, tol=tol, normalize=normalize, rounds=rounds,
                           init_rank=r0, solver_options=solver_options, device=device) for r0 in starts]
        return min(results, key=lambda res: res.objective[-1])  # ties: the first (rank R) start
    solve = _SOLVERS[method]
    fit_args = dict(iters=iters, tol=tol, normalize=normalize, seed=seed, device=device, **(solver_options or {}))

    if K == 1:
        labels = [0] * n
    else:
        rank0 = init_rank or R
        if method == "jd-full":
            rank0 = min(rank0, int(factors[0].A.shape[1]), int(factors[0].B.shape[0]))
        joint = solve(factors, rank0, **fit_args)
        features = joint.cores / (joint.norms if normalize else torch.ones_like(joint.norms)).reshape(
            -1, *([1] * (joint.cores.dim() - 1))
        )
        labels = kmeans(features.reshape(n, -1), K, seed=seed)

    everyone = FactoredCollection(factors, R, normalize, device)

    def fit_all(labels, previous):
        members = [[i for i in range(n) if labels[i] == c] for c in range(K)]
        starts = previous or ["svd"] * K
        return members, [solve([factors[i] for i in members[c]], R, init=starts[c], **fit_args) for c in range(K)]

    members, fits = fit_all(labels, None)
    history = [sum(f.objective[-1] for f in fits)]
    converged, done = K == 1, 0
    while not converged and done < rounds:
        done += 1
        err = torch.stack([everyone.best_core_errors(f.U, f.V, method).cpu() for f in fits], dim=1)  # [n, K]
        current = torch.tensor(labels)
        best = err.argmin(dim=1)
        moves = err[torch.arange(n), best] < err[torch.arange(n), current] - _SWITCH_MARGIN
        new = _fill_empty(torch.where(moves, best, current), err, K).tolist()
        if new == labels:
            converged = True
            break
        labels = new
        members, fits = fit_all(labels, [(f.U, f.V) for f in fits])
        history.append(sum(f.objective[-1] for f in fits))

    order = sorted(range(K), key=lambda c: members[c][0])  # cluster ids by first member
    rename = {old: new for new, old in enumerate(order)}
    fits = [fits[c] for c in order]
    members = [members[c] for c in order]
    assignments = [rename[c] for c in labels]
    errors = [0.0] * n
    for c, fit in enumerate(fits):
        for i, e in zip(members[c], relative_errors([factors[i] for i in members[c]], fit)):
            errors[i] = e
    return ClusterResult(method, R, assignments, members, fits, errors, done, converged, seed, history)


def auto_clusters(
    factors,
    R: int,
    max_error: float,
    method: str = "jd-full",
    *,
    max_clusters: int | None = None,
    **options,
) -> ClusterResult:
    """The smallest K whose clustering keeps every adapter's squared relative error at or below ``max_error``.

    Tries K = 1, 2, ... up to ``max_clusters`` (default: every adapter its own
    cluster). If none meets the bound, returns the last fit tried: the
    caller's gate sees its offenders in ``errors``. ``options`` go to :func:`cluster`.
    """
    n = len(factors)
    top = n if max_clusters is None else min(max_clusters, n)
    if top < 1:
        raise CompressError("E_COMPRESS_CLUSTERS", f"max_clusters must be >= 1, got {max_clusters}")
    for K in range(1, top + 1):
        result = cluster(factors, R, K, method, **options)
        if max(result.errors) <= max_error:
            return result
    return result
