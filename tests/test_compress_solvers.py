"""JD-Full / JD-Diag solvers, clustering and the parameter ledger against spec 0x06G1-0x06G6 and TensorLy."""

import os
import subprocess
import sys
import warnings
from fractions import Fraction

import pytest
import torch

from mlora.compress import (
    CompressError,
    FactoredCollection,
    FactoredDelta,
    JDResult,
    auto_clusters,
    break_even_n,
    cluster,
    jd_diag,
    jd_full,
    joint_apply,
    kmeans,
    module_ledger,
    relative_errors,
    squared_errors,
    total_ledger,
)

F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny GEMMs: a busy shared CPU makes OpenMP thread hand-offs cost more than the maths.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- helpers


def rand(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=F64)


def orthonormal(gen, d, r):
    return torch.linalg.qr(rand(gen, d, r))[0]


def random_adapters(gen, n, d_out, d_in, ranks, scale=0.5):
    ranks = ranks if isinstance(ranks, list) else [ranks] * n
    return [FactoredDelta(A=rand(gen, r, d_in), B=rand(gen, d_out, r), scale=scale) for r in ranks]


def stacked(factors, normalize=False):
    """The adapter-stacked tensor [d_out, d_in, n] TensorLy sees (small problems only)."""
    dense = [f.dense() for f in factors]
    if normalize:
        dense = [d / torch.linalg.matrix_norm(d) for d in dense]
    return torch.stack(dense, dim=-1)


def monotone(objective, total):
    """Non-increasing up to the round-off of an objective computed as ||Delta||^2 minus captured energy."""
    return all(b <= a + 1e-12 * total for a, b in zip(objective, objective[1:]))


def dense_errors(factors, result):
    return [float(torch.linalg.matrix_norm(f.dense() - result.dense(i)) ** 2) for i, f in enumerate(factors)]


# ---------------------------------------------------------------- 0x06G2: the Loop 6 fixture

U6 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=F64)
V6 = U6.clone()
CORES6 = torch.tensor([[[1, 0], [0, 2]], [[0, 3], [4, 0]], [[2, -1], [1, 1]]], dtype=F64)  # a, b, c


def fixture6():
    """Delta_i = U Sigma_i V^T, factored as B_i = U Sigma_i, A_i = V^T."""
    return [FactoredDelta(A=V6.T.clone(), B=U6 @ s) for s in CORES6]


def displayed(method):
    cores = CORES6 if method == "jd-full" else torch.diagonal(CORES6, dim1=1, dim2=2)
    return JDResult(method, U6, V6, cores, torch.zeros(3, dtype=F64), False, 0, True, 0)


def test_fixture_jd_full_reconstructs_the_three_cores_exactly():
    facs = fixture6()
    assert squared_errors(facs, displayed("jd-full")) == [0.0, 0.0, 0.0]
    # the optimal core for the displayed bases is U^T Delta_i V: the displayed cores
    for f, core in zip(facs, CORES6):
        assert torch.equal(U6.T @ f.dense() @ V6, core)
    fit = jd_full(facs, 2, iters=20)
    assert max(relative_errors(facs, fit)) < 1e-28
    assert fit.converged and fit.objective[-1] == 0.0
    assert torch.allclose(fit.U.T @ fit.U, torch.eye(2, dtype=F64), atol=1e-14)
    for i, f in enumerate(facs):
        assert torch.allclose(fit.dense(i), f.dense(), atol=1e-13)


def test_fixture_jd_diag_rank_2_cannot_reconstruct_three_independent_updates():
    facs = fixture6()
    vecs = torch.stack([f.dense().reshape(-1) for f in facs], dim=1)  # [9, 3]
    assert int(torch.linalg.matrix_rank(vecs)) == 3
    # Any rank-2 JD-Diag collection spans at most 2 dimensions of vec space, so its
    # error is at least the smallest squared singular value (Eckart-Young): 1.8605 > 0.
    bound = float(torch.linalg.svdvals(vecs)[-1] ** 2)
    assert bound > 1.86
    fits = [jd_diag(facs, 2, iters=500, tol=1e-13, normalize=False)]
    fits += [jd_diag(facs, 2, iters=500, tol=1e-13, normalize=False, init="random", seed=s) for s in range(4)]
    errors = [sum(squared_errors(facs, fit)) for fit in fits]
    assert min(errors) >= bound * (1 - 1e-9)
    # on this fixture the optimum attains the bound (its best 2-D pencil holds two rank-one atoms)
    assert min(errors) == pytest.approx(bound, rel=1e-6)
    # the witness of the spec: displayed bases, off-diagonal core entries dropped
    assert squared_errors(facs, displayed("jd-diag")) == pytest.approx([0.0, 25.0, 2.0], abs=1e-12)
    assert sum(squared_errors(facs, displayed("jd-diag"))) == pytest.approx(27.0, abs=1e-12)


# ---------------------------------------------------------------- 0x06G3: parameter ledger


def test_ledger_fixture_counts_and_break_even():
    full = module_ledger(3, 3, [2, 2, 2], R=2, method="jd-full")
    diag = module_ledger(3, 3, [2, 2, 2], R=2, method="jd-diag")
    assert (full.S, full.n) == (6, 3)
    assert full.lora_params == diag.lora_params == 36
    assert full.fp16_bytes() == {"lora": 72, "payload": 48}
    assert (full.payload_params, full.shared_params, full.core_params) == (24, 12, 12)
    assert diag.payload_params == 18 and diag.fp16_bytes()["payload"] == 36
    assert full.break_even_n == diag.break_even_n == 2
    assert full.saves and diag.saves


def test_ledger_large_illustration():
    full = module_ledger(4096, 4096, [16] * 1000, R=32, method="jd-full")
    diag = module_ledger(4096, 4096, [16] * 1000, R=32, method="jd-diag")
    assert full.lora_params == 131_072_000
    assert full.payload_params == 1_286_144
    assert diag.payload_params == 294_144
    # n (16 * 8192 - 1024) > 32 * 8192  ->  n > 2.0...  ->  3
    assert full.break_even_n == 3 and diag.break_even_n == 3


def test_ledger_no_break_even_when_denominator_not_positive():
    # r0 S - R^2 = 2 * 6 - 16 < 0: no collection size makes JD-Full smaller
    assert module_ledger(3, 3, [2, 2, 2], R=4, method="jd-full").break_even_n is None
    assert break_even_n(12, 0) is None
    assert break_even_n(12, Fraction(12, 1)) == 2  # n > 1 exactly: strict inequality
    assert break_even_n(12, 8) == 2  # n > 1.5


def test_ledger_clusters_mixed_ranks_and_totals():
    led = module_ledger(3, 3, [2, 2, 2], R=2, method="jd-full", clusters=2)
    assert led.payload_params == 2 * 2 * 6 + 3 * 4  # k R S + n R^2
    assert led.paper_params == 2 * 2 * 6 + 3 * (4 + 1)  # k R S + n (R^2 + 1)
    assert led.break_even_n == 4  # n (12 - 4) > 24
    mixed = module_ledger(10, 6, [1, 2, 4, 8], R=4, method="jd-diag")
    assert mixed.lora_params == 16 * 15
    assert mixed.mean_source_rank == Fraction(15, 4)
    assert mixed.break_even_n == 2  # n (60 - 4) > 64
    tot = total_ledger([module_ledger(3, 3, [2, 2, 2], R=2, method="jd-full")] * 2)
    assert (tot.lora_params, tot.payload_params, tot.break_even_n) == (72, 48, 2)
    with pytest.raises(CompressError) as err:
        total_ledger([module_ledger(3, 3, [2, 2], 2, "jd-full"), module_ledger(3, 3, [2], 2, "jd-full")])
    assert err.value.code == "E_COMPRESS_SHAPE"
    with pytest.raises(CompressError) as err:
        module_ledger(3, 3, [2], 2, "svd")
    assert err.value.code == "E_COMPRESS_METHOD"


# ---------------------------------------------------------------- 0x06G4: the runtime operator


def test_runtime_operator_fixture():
    X = torch.tensor([[1, 2, 3], [0, -1, 2]], dtype=F64)
    assert torch.equal(X @ V6, torch.tensor([[1, 2], [0, -1]], dtype=F64))
    delta_b = fixture6()[1].dense()
    out = joint_apply(X, U6, V6, CORES6[1])
    assert torch.equal(out, torch.tensor([[6, 4, 0], [-3, 0, 0]], dtype=F64))
    assert torch.equal(out, X @ delta_b.T)


def test_runtime_operator_on_fitted_bases():
    gen = torch.Generator().manual_seed(11)
    facs = random_adapters(gen, 5, 12, 9, [2, 3, 1, 2, 1])  # joint row space: all 9 dims
    X = rand(gen, 4, 9)
    for fit in (jd_full(facs, 8, iters=50), jd_diag(facs, 5, iters=50)):
        for i in range(len(facs)):
            assert torch.allclose(joint_apply(X, fit.U, fit.V, fit.cores[i]), X @ fit.dense(i).T, atol=1e-12)
    # R = 9 covers the joint column space (sum of ranks): exact, so the three stages give X Delta_i^T
    fit = jd_full(facs, 9, iters=50)
    for i, f in enumerate(facs):
        assert torch.allclose(joint_apply(X, fit.U, fit.V, fit.cores[i]), X @ f.dense().T, atol=1e-11)


# ---------------------------------------------------------------- synthetic structure


def shared_basis_collection(gen, n=8, d_out=40, d_in=30, true_rank=5, ranks=(5, 3, 4, 5, 2, 5, 1, 4)):
    U0, V0 = rand(gen, d_out, true_rank), rand(gen, d_in, true_rank)
    return [
        FactoredDelta(A=rand(gen, r, true_rank) @ V0.T, B=U0 @ rand(gen, true_rank, r), scale=0.25 * (i + 1))
        for i, r in enumerate(ranks[:n])
    ]


def test_exactly_shared_bases_jd_full_exact_at_true_rank():
    gen = torch.Generator().manual_seed(1)
    facs = shared_basis_collection(gen)
    for R in (5, 6, 9):
        fit = jd_full(facs, R, iters=100, tol=1e-12)
        assert max(relative_errors(facs, fit)) < 1e-24
    short = jd_full(facs, 4, iters=100, tol=1e-12)
    assert max(relative_errors(facs, short)) > 1e-3


def test_truly_diagonal_cores_jd_diag_exact():
    gen = torch.Generator().manual_seed(2)
    U0, V0 = rand(gen, 24, 4), rand(gen, 18, 4)
    facs = [FactoredDelta(A=V0.T.clone(), B=U0 * rand(gen, 4), scale=3.0) for _ in range(10)]
    # the default start (HOSVD bases, least-squares cores first) recovers the atoms
    assert max(relative_errors(facs, jd_diag(facs, 4, iters=100, tol=1e-14))) < 1e-12
    # a start with two equal columns stays in a swamp (ALS keeps them equal); two random restarts escape it
    U, V = rand(gen, 24, 4), rand(gen, 18, 4)
    U[:, 1], V[:, 1] = U[:, 0], V[:, 0]
    stalled = jd_diag(facs, 4, iters=100, tol=1e-14, init=(U, V))
    assert max(relative_errors(facs, stalled)) > 0.1
    fit = jd_diag(facs, 4, iters=500, tol=1e-14, init=(U, V), restarts=2)
    assert max(relative_errors(facs, fit)) < 1e-12  # the Gram objective's round-off floor, ~64 eps
    # the same collection with full random cores is beyond rank-4 JD-Diag, not beyond JD-Full
    gen = torch.Generator().manual_seed(2)
    full = [FactoredDelta(A=V0.T.clone(), B=U0 @ rand(gen, 4, 4)) for _ in range(10)]
    assert max(relative_errors(full, jd_diag(full, 4, iters=300))) > 0.05
    assert max(relative_errors(full, jd_full(full, 4, iters=50))) < 1e-24


def clustered_collection(gen, K=3, per=5, true_rank=3, d_out=32, d_in=24, diagonal=False):
    bases = [(rand(gen, d_out, true_rank), rand(gen, d_in, true_rank)) for _ in range(K)]
    facs, truth = [], []
    for i in range(K * per):
        c = i % K
        U, V = bases[c]
        B = U * rand(gen, true_rank) if diagonal else U @ rand(gen, true_rank, true_rank)
        facs.append(FactoredDelta(A=V.T.clone(), B=B, scale=1.0 + i))
        truth.append(c)
    return facs, truth


def same_partition(a, b):
    return {tuple(i for i in range(len(a)) if a[i] == c) for c in set(a)} == {
        tuple(i for i in range(len(b)) if b[i] == c) for c in set(b)
    }


@pytest.mark.parametrize("method", ["jd-full", "jd-diag"])
def test_clustered_structure_recovered_at_the_right_k(method):
    facs, truth = clustered_collection(torch.Generator().manual_seed(5), diagonal=method == "jd-diag")
    one = cluster(facs, 3, 1, method, iters=200, tol=1e-12)
    assert one.K == 1 and max(one.errors) > 0.5
    right = cluster(facs, 3, 3, method, iters=300, tol=1e-13, seed=0)
    assert max(right.errors) < 1e-12
    assert same_partition(right.assignments, truth)
    assert right.converged
    assert monotone(right.objective, len(facs))
    # accessors agree with the per-cluster fits
    for i in range(len(facs)):
        U, V = right.bases(i)
        full_core = torch.diag(right.core(i)) if method == "jd-diag" else right.core(i)
        delta = facs[i].dense()
        assert torch.linalg.matrix_norm(U @ full_core @ V.T - delta) <= 1e-5 * torch.linalg.matrix_norm(delta)


def test_auto_clusters_picks_the_smallest_k():
    facs, truth = clustered_collection(torch.Generator().manual_seed(5))
    res = auto_clusters(facs, 3, 1e-8, "jd-full", iters=200, tol=1e-12)
    assert res.K == 3 and same_partition(res.assignments, truth)
    krylov = cluster(facs, 3, 3, "jd-full", iters=200, tol=1e-12, solver_options={"eigensolver": "krylov"})
    assert same_partition(krylov.assignments, truth) and max(krylov.errors) < 1e-12
    # a bound no K below the cap meets: the last fit comes back for the caller's gate
    capped = auto_clusters(facs, 2, 1e-8, "jd-full", max_clusters=2, iters=50)
    assert capped.K == 2 and max(capped.errors) > 1e-8


def test_independent_random_adapters_error_reported_honestly():
    gen = torch.Generator().manual_seed(9)
    facs = random_adapters(gen, 12, 48, 40, 8)
    fit = jd_full(facs, 16, iters=30)
    errors = relative_errors(facs, fit)
    assert errors == pytest.approx(dense_errors(facs, fit) / (fit.norms**2).numpy(), rel=1e-9)
    # 12 independent rank-8 updates need R ~ 96 for exactness; R = 16 keeps little of each
    assert min(errors) > 0.4 and max(errors) < 1.0
    assert sum(errors) / len(errors) > 0.5


# ---------------------------------------------------------------- agreement with TensorLy


@pytest.fixture
def tensorly_numpy():
    """TensorLy on its NumPy backend, whatever another test in this process set."""
    tl = pytest.importorskip("tensorly")
    from tensorly.decomposition import parafac, partial_tucker

    with tl.backend_context("numpy"):
        yield tl, parafac, partial_tucker


# (n, d_out, d_in, ranks, R): the second and fourth take the reduced path (sum r_i < d)
PROBLEMS = [
    (6, 20, 15, 3, 3),
    (5, 40, 36, [1, 2, 3, 2, 1], 4),
    (8, 16, 16, 4, 6),
    (3, 30, 24, 2, 5),
]


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("problem", PROBLEMS)
def test_jd_full_matches_tensorly_partial_tucker(problem, normalize, tensorly_numpy):
    tl, _, partial_tucker = tensorly_numpy
    n, d_out, d_in, ranks, R = problem
    facs = random_adapters(torch.Generator().manual_seed(n * d_out + R), n, d_out, d_in, ranks)
    T = stacked(facs, normalize).numpy()
    (core, (U, V)), _ = partial_tucker(T, [R, R], modes=[0, 1], n_iter_max=500, tol=1e-14)
    theirs = float(((T - tl.tenalg.multi_mode_dot(core, [U, V], modes=[0, 1])) ** 2).sum())
    fit = jd_full(facs, R, iters=500, tol=1e-14, normalize=normalize)
    ours = sum(relative_errors(facs, fit)) if normalize else sum(squared_errors(facs, fit))
    assert ours == pytest.approx(theirs, rel=1e-6)
    assert fit.objective[-1] == pytest.approx(ours, rel=1e-6)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("problem", PROBLEMS)
def test_jd_diag_equals_tensorly_parafac_with_the_adapter_mode_first(problem, normalize, tensorly_numpy):
    # PARAFAC of the [n, d_out, d_in] stack from its SVD start updates the adapter mode first: the
    # least-squares cores of the HOSVD bases, then U, V, cores, ... as jd_diag's default start, so
    # both converge to the same fit (the block order decides which local minimum ALS reaches)
    tl, parafac, _ = tensorly_numpy
    n, d_out, d_in, ranks, R = problem
    facs = random_adapters(torch.Generator().manual_seed(n * d_in + R), n, d_out, d_in, ranks)
    T = stacked(facs, normalize).permute(2, 0, 1).numpy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # R > n: TensorLy pads its SVD init with random columns
        cp = parafac(tl.tensor(T), R, n_iter_max=1000, tol=1e-12, init="svd", random_state=0)
    theirs = float(((T - tl.cp_to_tensor(cp)) ** 2).sum())
    fit = jd_diag(facs, R, iters=1000, tol=1e-12, normalize=normalize)
    ours = sum(relative_errors(facs, fit)) if normalize else sum(squared_errors(facs, fit))
    assert ours == pytest.approx(theirs, rel=1e-8)
    assert fit.objective[-1] == pytest.approx(ours, rel=1e-6)


# ---------------------------------------------------------------- solver properties


@pytest.mark.parametrize("solver", [jd_full, jd_diag])
def test_objective_monotone_and_matches_exact_errors(solver):
    gen = torch.Generator().manual_seed(4)
    facs = random_adapters(gen, 7, 18, 14, [3, 1, 4, 2, 3, 2, 4])
    for normalize in (False, True):
        fit = solver(facs, 4, iters=200, tol=1e-12, normalize=normalize, init="random", seed=3)
        obj = fit.objective
        assert monotone(obj, len(facs) if normalize else float((fit.norms**2).sum()))
        exact = sum(relative_errors(facs, fit)) if normalize else sum(squared_errors(facs, fit))
        assert obj[-1] == pytest.approx(exact, rel=1e-8)
        assert fit.iterations == len(obj) - 1


def test_factored_errors_equal_dense_computation():
    gen = torch.Generator().manual_seed(6)
    facs = random_adapters(gen, 6, 11, 13, [1, 5, 2, 3, 4, 2], scale=1.7)
    for fit in (jd_full(facs, 3, iters=20), jd_diag(facs, 7, iters=20)):
        assert squared_errors(facs, fit) == pytest.approx(dense_errors(facs, fit), rel=1e-10)
        norms = [float(torch.linalg.matrix_norm(f.dense())) for f in facs]
        assert fit.norms.tolist() == pytest.approx(norms, rel=1e-13)
    # a residual far below ||Delta||^2 keeps its own relative accuracy (no Gram cancellation)
    tiny = [FactoredDelta(A=f.A, B=f.B, scale=f.scale) for f in facs]
    exact = jd_full(tiny, 11, iters=5)
    perturbed = JDResult("jd-full", exact.U, exact.V, exact.cores + 1e-9, exact.norms, False, 0, True, 0)
    assert squared_errors(tiny, perturbed) == pytest.approx(dense_errors(tiny, perturbed), rel=1e-4)


def test_chunked_errors_equal_single_pass():
    gen = torch.Generator().manual_seed(8)
    facs = random_adapters(gen, 9, 10, 12, [2, 3, 1, 4, 2, 2, 3, 1, 4])
    fit = jd_diag(facs, 3, iters=10)
    assert squared_errors(facs, fit, chunk=2) == pytest.approx(squared_errors(facs, fit), rel=1e-12)


def test_normalisation_restores_norms_into_cores():
    gen = torch.Generator().manual_seed(10)
    facs = shared_basis_collection(gen)
    big = [FactoredDelta(A=f.A, B=f.B, scale=f.scale * 10.0 ** (2 * i - 6)) for i, f in enumerate(facs[:5])]
    fit = jd_full(big, 5, iters=100, tol=1e-12, normalize=True)
    norms = torch.tensor([float(torch.linalg.matrix_norm(f.dense())) for f in big], dtype=F64)
    assert torch.allclose(fit.norms, norms, rtol=1e-13)
    # cores carry the original scale: ||Sigma_i|| = ||U^T Delta_i V|| = ||Delta_i|| when exact
    assert torch.allclose(torch.linalg.matrix_norm(fit.cores), norms, rtol=1e-10)
    assert max(relative_errors(big, fit)) < 1e-20
    diag = jd_diag(big, 5, iters=5, normalize=True)
    assert torch.equal(diag.norms, fit.norms)
    assert diag.objective[-1] == pytest.approx(sum(relative_errors(big, diag)), rel=1e-8)
    # without normalisation the objective is dominated by the largest update; with it, each counts once
    lopsided = random_adapters(torch.Generator().manual_seed(12), 4, 10, 10, 3)
    lopsided[0] = FactoredDelta(A=lopsided[0].A, B=lopsided[0].B, scale=1e3)
    raw = relative_errors(lopsided, jd_full(lopsided, 3, iters=50, normalize=False))
    fair = relative_errors(lopsided, jd_full(lopsided, 3, iters=50, normalize=True))
    assert raw[0] < 1e-3 and max(raw[1:]) > max(fair[1:])


def test_deterministic_under_seed():
    gen = torch.Generator().manual_seed(13)
    facs = random_adapters(gen, 6, 14, 12, [2, 3, 2, 1, 3, 2])
    for solver in (jd_full, jd_diag):
        a = solver(facs, 3, iters=15, init="random", seed=7)
        b = solver(facs, 3, iters=15, init="random", seed=7)
        c = solver(facs, 3, iters=15, init="random", seed=8)
        assert torch.equal(a.U, b.U) and torch.equal(a.V, b.V) and torch.equal(a.cores, b.cores)
        assert not torch.equal(a.U, c.U)
    facs, _ = clustered_collection(torch.Generator().manual_seed(14), K=3, per=4)
    r1 = cluster(facs, 2, 3, "jd-full", seed=5, iters=20)
    r2 = cluster(facs, 2, 3, "jd-full", seed=5, iters=20)
    assert r1.assignments == r2.assignments and r1.errors == r2.errors
    assert all(torch.equal(f1.U, f2.U) for f1, f2 in zip(r1.fits, r2.fits))
    points = rand(torch.Generator().manual_seed(0), 30, 4)
    assert kmeans(points, 4, seed=3) == kmeans(points, 4, seed=3)


def test_warm_start_is_not_worse():
    gen = torch.Generator().manual_seed(15)
    facs = random_adapters(gen, 6, 16, 16, 3)
    first = jd_full(facs, 4, iters=3)
    again = jd_full(facs, 4, iters=3, init=(first.U, first.V))
    assert again.objective[-1] <= first.objective[-1] * (1 + 1e-12)
    d1 = jd_diag(facs, 4, iters=3)
    d2 = jd_diag(facs, 4, iters=3, init=(d1.U, d1.V))
    assert d2.objective[0] <= d1.objective[-1] * (1 + 1e-9)


def test_kmeans_separates_blobs_and_keeps_clusters_non_empty():
    gen = torch.Generator().manual_seed(16)
    centers = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]], dtype=F64)
    points = torch.cat([c + 0.1 * rand(gen, 5, 2) for c in centers])
    labels = kmeans(points, 3, seed=0)
    assert same_partition(labels, [i // 5 for i in range(15)])
    twins = torch.zeros(4, 2, dtype=F64)  # fewer distinct points than clusters
    assert sorted(set(kmeans(twins, 3, seed=0))) == [0, 1, 2]


def test_kmeans_of_wide_points_runs_in_their_span_with_the_same_geometry():
    """Points of more dimensions than points (a joint rank-512 start's cores are 262,144-wide)
    are clustered in the coordinates of their span: every pairwise distance is unchanged, and
    the labelling equals k-means on the raw points (a plain Lloyd with the same seeding)."""
    from mlora.compress.cluster import _fill_empty, _plusplus, span_coordinates

    gen = torch.Generator().manual_seed(18)
    centers = 3.0 * rand(gen, 4, 300)
    points = torch.cat([c + rand(gen, 6, 300) for c in centers])  # 24 points, 300 dimensions
    coords = span_coordinates(points)
    assert coords.shape == (24, 24)
    assert torch.allclose(torch.cdist(coords, coords), torch.cdist(points, points), rtol=1e-10, atol=1e-9)

    def raw_lloyd(X, K, seed, n_init=4):  # the definition, on the raw points
        g = torch.Generator().manual_seed(seed)
        best = None
        for _ in range(n_init):
            c, labels = _plusplus(X, K, g), None
            for _ in range(100):
                dist = torch.cdist(X, c).square()
                new = _fill_empty(dist.argmin(dim=1), dist, K)
                if labels is not None and torch.equal(new, labels):
                    break
                labels = new
                c = torch.stack([X[labels == k].mean(dim=0) for k in range(K)])
            inertia = float(torch.cdist(X, c).square()[torch.arange(len(X)), labels].sum())
            if best is None or inertia < best[0]:
                best = (inertia, labels.tolist())
        return best[1]

    for K, seed in ((4, 0), (3, 5), (6, 9)):
        assert kmeans(points, K, seed=seed) == raw_lloyd(points, K, seed)
    assert same_partition(kmeans(points, 4, seed=1), [i // 6 for i in range(24)])


def test_errors_are_named():
    gen = torch.Generator().manual_seed(17)
    facs = random_adapters(gen, 3, 6, 5, 2)
    cases = [
        (lambda: jd_full([], 2), "E_COMPRESS_EMPTY"),
        (lambda: jd_full(facs, 6), "E_COMPRESS_RANK"),
        (lambda: jd_diag(facs, 0), "E_COMPRESS_RANK"),
        (lambda: jd_full(facs + random_adapters(gen, 1, 6, 4, 2), 2), "E_COMPRESS_SHAPE"),
        (lambda: jd_full([FactoredDelta(A=rand(gen, 2, 5), B=rand(gen, 6, 3))], 2), "E_COMPRESS_SHAPE"),
        (lambda: jd_full([(rand(gen, 2, 5), rand(gen, 6, 2))], 2), "E_COMPRESS_SHAPE"),
        (lambda: jd_full(facs + [FactoredDelta(A=rand(gen, 2, 5), B=torch.zeros(6, 2, dtype=F64))], 2), "E_COMPRESS_ZERO_DELTA"),
        (lambda: jd_full(facs, 2, init="pca"), "E_COMPRESS_INIT"),
        (lambda: jd_full(facs, 2, init=(rand(gen, 6, 3), rand(gen, 5, 3))), "E_COMPRESS_INIT"),
        (lambda: cluster(facs, 2, 4), "E_COMPRESS_CLUSTERS"),
        (lambda: cluster(facs, 2, 2, "tucker"), "E_COMPRESS_METHOD"),
    ]
    for call, code in cases:
        with pytest.raises(CompressError) as err:
            call()
        assert err.value.code == code, code
    # without normalisation a zero update is allowed and reconstructed exactly
    zero = facs + [FactoredDelta(A=rand(gen, 2, 5), B=torch.zeros(6, 2, dtype=F64))]
    fit = jd_full(zero, 2, normalize=False)
    assert relative_errors(zero, fit)[-1] == 0.0


def test_best_core_errors_match_exact_errors():
    gen = torch.Generator().manual_seed(18)
    facs = random_adapters(gen, 5, 12, 10, [2, 3, 1, 2, 2])
    for solver, method in ((jd_full, "jd-full"), (jd_diag, "jd-diag")):
        fit = solver(facs, 3, iters=30)
        col = FactoredCollection(facs, 3, True, "cpu")
        assert col.best_core_errors(fit.U, fit.V, method).tolist() == pytest.approx(relative_errors(facs, fit), abs=1e-12)


def test_large_module_never_materialises_per_adapter_deltas():
    # 16 adapters at 8192 x 8192: dense deltas would take 8 GiB in float64.
    code = (
        "import resource, torch\n"
        "from mlora.compress import FactoredDelta, jd_full, jd_diag, relative_errors\n"
        "g = torch.Generator().manual_seed(0)\n"
        "f = [FactoredDelta(A=torch.randn(4, 8192, generator=g), B=torch.randn(8192, 4, generator=g)) for _ in range(16)]\n"
        "e = relative_errors(f, jd_full(f, 32, iters=3)) + relative_errors(f, jd_diag(f, 8, iters=3))\n"
        "assert all(0 <= x <= 1 for x in e)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    peak_kib = int(out.stdout.strip().splitlines()[-1])
    assert peak_kib < 2 * 1024 * 1024  # well under one dense 8192^2 float64 matrix per adapter


def gap_collection(gen, n=10, d_out=60, d_in=50, true_rank=4, noise=1e-3):
    """Shared rank-4 structure plus small independent noise: a clear spectral gap at R = 4."""
    U0, V0 = rand(gen, d_out, true_rank), rand(gen, d_in, true_rank)
    facs = []
    for _ in range(n):
        B = torch.cat([U0 @ rand(gen, true_rank, true_rank), noise * rand(gen, d_out, 2)], dim=1)
        A = torch.cat([V0.T, rand(gen, 2, d_in)], dim=0)
        facs.append(FactoredDelta(A=A, B=B))
    return facs


def test_krylov_eigensolver_reaches_the_eigh_optimum(tensorly_numpy):
    tl, _, partial_tucker = tensorly_numpy
    facs = gap_collection(torch.Generator().manual_seed(19))
    exact = jd_full(facs, 4, iters=200, tol=1e-13, eigensolver="eigh")
    krylov = jd_full(facs, 4, iters=200, tol=1e-13, eigensolver="krylov")
    assert monotone(krylov.objective, len(facs))
    assert sum(relative_errors(facs, krylov)) == pytest.approx(sum(relative_errors(facs, exact)), rel=1e-6)
    T = stacked(facs, normalize=True).numpy()
    (core, (U, V)), _ = partial_tucker(T, [4, 4], modes=[0, 1], n_iter_max=500, tol=1e-14)
    theirs = float(((T - tl.tenalg.multi_mode_dot(core, [U, V], modes=[0, 1])) ** 2).sum())
    assert sum(relative_errors(facs, krylov)) == pytest.approx(theirs, rel=1e-6)
    # exact structure: the Krylov path is exact too, from a random start and from the HOSVD one
    shared = shared_basis_collection(torch.Generator().manual_seed(1))
    for init in ("svd", "random"):
        assert max(relative_errors(shared, jd_full(shared, 6, iters=100, init=init, eigensolver="krylov"))) < 1e-20
    # on a hard random problem it stays monotone and close to the exact path at the same sweeps
    hard = random_adapters(torch.Generator().manual_seed(20), 12, 40, 36, 4)
    a = jd_full(hard, 8, iters=30, tol=0, eigensolver="eigh")
    b = jd_full(hard, 8, iters=30, tol=0, eigensolver="krylov")
    assert monotone(b.objective, len(hard))
    assert b.objective[-1] == pytest.approx(a.objective[-1], rel=1e-2)
    with pytest.raises(CompressError) as err:
        jd_full(hard, 8, eigensolver="lanczos")
    assert err.value.code == "E_COMPRESS_EIGENSOLVER"


def test_wide_module_takes_the_krylov_path_and_stays_exact():
    # sum r_i = 520 > 512: auto chooses Krylov eigenspaces (no 600 x 600 Gram) for both methods
    gen = torch.Generator().manual_seed(21)
    U0, V0 = rand(gen, 600, 4), rand(gen, 560, 4)
    facs = [FactoredDelta(A=(V0 * rand(gen, 4)).T.contiguous(), B=U0.clone()) for _ in range(130)]
    diag = jd_diag(facs, 4, iters=100, tol=1e-13)
    assert max(relative_errors(facs, diag)) < 1e-12
    full = jd_full(facs, 4, iters=20)
    assert max(relative_errors(facs, full)) < 1e-20
    assert torch.allclose(full.U.T @ full.U, torch.eye(4, dtype=F64), atol=1e-13)


# ---------------------------------------------------------------- tall-skinny orthonormalisation


def spans(Q, X):
    """Relative residual of projecting X onto range(Q): 0 when range(Q) contains range(X)."""
    return float(torch.linalg.matrix_norm(X - Q @ (Q.T @ X)) / torch.linalg.matrix_norm(X))


def test_orthonormal_columns_well_conditioned_is_the_positive_diagonal_qr():
    from mlora.compress.solvers import orthonormal_columns

    for seed, (m, k) in enumerate([(500, 40), (4096, 64), (64, 64), (30, 1)]):
        X = rand(torch.Generator().manual_seed(100 + seed), m, k)
        Q = orthonormal_columns(X)
        assert Q.shape == (m, k)
        assert (Q.T @ Q - torch.eye(k, dtype=F64)).abs().max() < 1e-12
        assert spans(Q, X) < 1e-12
        H, T = torch.linalg.qr(X)
        assert torch.allclose(Q, H * torch.sign(torch.diagonal(T)), atol=1e-12)  # Householder's, up to column signs
        assert torch.equal(orthonormal_columns(X), Q)  # deterministic


def test_orthonormal_columns_of_rank_deficient_blocks_fall_back_to_householder():
    """Zero columns (the padded stacks of ``_reduce``) and nearly dependent ones still give orthonormal
    columns spanning X's range; a broken CholeskyQR2 result (NaN, inf, lost orthogonality) is never returned."""
    from mlora.compress.solvers import orthonormal_columns

    gen = torch.Generator().manual_seed(110)
    padded = torch.cat([rand(gen, 200, 12), torch.zeros(200, 8, dtype=F64)], dim=1)
    holes = rand(gen, 150, 10)
    holes[:, [2, 7]] = 0.0
    Y, Z = rand(gen, 300, 8), rand(gen, 300, 8)
    nearly = [torch.cat([Y, Y + eps * Z], dim=1) for eps in (1e-5, 1e-9, 1e-13)]
    low_rank = rand(gen, 400, 3) @ rand(gen, 3, 16)  # rank 3 of 16 columns
    # singular values 1, 1e-6, 1e-12: here both Choleskys succeed but Q^T Q is off by ~3e-11
    g250 = torch.Generator().manual_seed(250)
    U, V = (torch.linalg.qr(torch.randn(d, 3, generator=g250, dtype=F64))[0] for d in (100, 3))
    graded = (U * torch.tensor([1.0, 1e-6, 1e-12], dtype=F64)) @ V.T
    for X in [padded, holes, *nearly, low_rank, graded]:
        Q = orthonormal_columns(X)
        assert Q.shape == X.shape and bool(torch.isfinite(Q).all())
        assert (Q.T @ Q - torch.eye(X.shape[1], dtype=F64)).abs().max() < 1e-12
        assert spans(Q, X) < 1e-12
    for X in (padded, holes, low_rank):  # Cholesky breaks down: exactly Householder's Q
        assert torch.equal(orthonormal_columns(X), torch.linalg.qr(X)[0])


def test_factored_norms_recompute_through_qr_where_the_product_cancels():
    from mlora.compress.solvers import _factored_norms

    gen = torch.Generator().manual_seed(111)
    x, y, a = rand(gen, 40, 1), rand(gen, 40, 1), rand(gen, 30, 1)
    near = x + 1e-6 * y
    B = torch.cat([x, near], dim=1)  # B [x, x + d] and A [a; -a]: B A = -d a^T, 1e-6 of ||B|| ||A||
    A = torch.cat([a.T, -a.T], dim=0)
    exact = float(torch.linalg.vector_norm(near - x) * torch.linalg.vector_norm(a))  # near - x is exact (Sterbenz)
    well = random_adapters(gen, 3, 40, 30, 2)
    Bt = torch.stack([B.T] + [f.B.T for f in well])
    As = torch.stack([A] + [f.A for f in well])
    norms = _factored_norms(Bt, As)
    assert float(norms[0]) == pytest.approx(exact, rel=1e-8)  # Gram terms alone would lose ~1e-4 here
    dense = [float(torch.linalg.matrix_norm(f.B @ f.A)) for f in well]
    assert norms[1:].tolist() == pytest.approx(dense, rel=1e-13)
    assert float(_factored_norms(torch.zeros(1, 2, 40, dtype=F64), As[:1])[0]) == 0.0
