"""JD-Full and JD-Diag joint decompositions of one adapter collection at one module (docs/compress.md).

Owns the numerical core of ``mlora compress`` for one (layer, module): the
fitted shared bases, the per-adapter cores and their exact reconstruction
errors. Knows nothing of adapter directories, bundles, clusters or serving;
those build on :func:`jd_full`, :func:`jd_diag` and :func:`relative_errors`.

Every adapter arrives factored, ``Delta_i = s_i B_i A_i`` with ``A_i [r_i, d_in]``
and ``B_i [d_out, r_i]`` (PEFT's ``lora_A`` / ``lora_B``; ranks may differ).
No ``d_out x d_in`` matrix is ever formed for an adapter: every product is
parenthesised through the factors (``B_i (A_i V)``, ``(U^T B_i)(A_i V)``), so
memory stays O(n r d) per module, plus one ``rho x rho`` Gram matrix where a
dense eigh is used (``rho = min(d, max(sum_i r_i, R))``, see
:class:`FactoredCollection`; wide modules take a Krylov path that forms none).

Solver maths runs in float64 on ``device`` (CPU by default, the same code on
CUDA); random draws come from a CPU ``torch.Generator(seed)`` so a seed gives
the same numbers on every device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.nn.functional import pad

METHODS = ("jd-full", "jd-diag")
_DTYPE = torch.float64
# Errors at the float64 round-off floor of ||Delta||^2 count as exact: the
# alternating loop stops there instead of chasing noise.
_EXACT_FLOOR = 64 * torch.finfo(_DTYPE).eps
# CholeskyQR2 output counts as orthonormal up to this many ulps in any entry
# of Q^T Q - I (a few tens where X's conditioning allows CholeskyQR2 at all).
_ORTHONORMAL_ULPS = 512
# Norms from Gram matrices are trusted while ||B||^2 ||A||^2 / ||B A||^2 stays
# below this; above it they are recomputed through QR (_factored_norms).
_GRAM_NORM_MAX_RHO2 = 1024


class CompressError(ValueError):
    """A collection that cannot be compressed as asked. ``code`` names the broken invariant."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class FactoredDelta:
    """One adapter's update at one module, ``Delta = scale * B @ A``.

    ``A`` is PEFT's ``lora_A`` [r, d_in], ``B`` its ``lora_B`` [d_out, r] and
    ``scale`` the semantic scale (``lora_alpha / r``, or rsLoRA's rule).
    """

    A: torch.Tensor
    B: torch.Tensor
    scale: float = 1.0

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])

    def dense(self) -> torch.Tensor:
        """The float64 ``d_out x d_in`` matrix: for tests and exports of small shapes only."""
        return float(self.scale) * (self.B.to(_DTYPE) @ self.A.to(_DTYPE))


@dataclass
class JDResult:
    """A fitted joint decomposition ``Delta_i ~= U Sigma_i V^T`` of n adapters.

    ``cores`` reconstruct the *original* updates (norms restored when the fit
    was normalised): [n, R, R] for JD-Full, [n, R] (the diagonals) for JD-Diag.
    ``objective`` holds the fitted objective after initialisation and after
    every sweep, in the units the fit minimised (a sum of squared *relative*
    errors when ``normalize``); it never increases.
    """

    method: str
    U: torch.Tensor  # [d_out, R]; orthonormal columns for JD-Full
    V: torch.Tensor  # [d_in, R]
    cores: torch.Tensor  # [n, R, R] or [n, R]
    norms: torch.Tensor  # [n] ||Delta_i||_F, float64
    normalize: bool
    iterations: int
    converged: bool
    seed: int
    objective: list[float] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return int(self.U.shape[1])

    def full_cores(self) -> torch.Tensor:
        """Cores as [n, R, R] matrices whatever the method."""
        return torch.diag_embed(self.cores) if self.method == "jd-diag" else self.cores

    def dense(self, i: int) -> torch.Tensor:
        """``U Sigma_i V^T`` as a dense matrix: for tests and exports of small shapes only."""
        return self.U @ self.full_cores()[i] @ self.V.T


# ---------------------------------------------------------------- the collection


class FactoredCollection:
    """The adapters of one module as the solvers see them: padded, maybe normalised, reduced to their span.

    Both factors are held as row stacks, ``Bt_i = (s_i B_i)^T`` [r, rho_B] and
    ``A_i`` [r, rho_A], so ``Delta_i = Bt_i^T A_i`` and every per-adapter
    product for all adapters at once is one 2-D GEMM on the [n r, rho] stack.
    Ranks are padded with zero rows to ``r_max``, which leaves every
    ``B_i A_i`` unchanged.

    ``[s_1 B_1 ... s_n B_n]`` (divided by ``||Delta_i||`` when normalising)
    has orthonormal range basis ``Q_B`` [d_out, rho_B]; every column space of
    every Delta_i lies in it, and so does every optimal U of either method (a
    component of U outside it only adds residual). The fit therefore runs on
    the reduced factors and ``U = Q_B U'``, ``V = Q_A V'`` at the end. The
    reduction is skipped (Q = identity) where ``sum_i r_i`` is not below the
    dimension.
    """

    def __init__(self, factors, R: int, normalize: bool, device):
        if R < 1:
            raise CompressError("E_COMPRESS_RANK", f"shared rank R must be >= 1, got {R}")
        check_factors(factors)
        self.device = torch.device(device)
        self.n = len(factors)
        self.d_in = int(factors[0].A.shape[1])
        self.d_out = int(factors[0].B.shape[0])
        self.ranks = [f.rank for f in factors]
        self.r = max(self.ranks)
        Bt, A = _padded_factors(factors, self.r, self.device)
        self.norms = _factored_norms(Bt, A)
        if normalize:
            zero = [i for i, v in enumerate(self.norms.tolist()) if v == 0.0]
            if zero:
                raise CompressError(
                    "E_COMPRESS_ZERO_DELTA",
                    f"adapter(s) {zero} have a zero update at this module; normalisation needs ||Delta_i|| > 0",
                )
            Bt = Bt / self.norms[:, None, None]
        # cores are fitted to Delta_i / weight_i and multiplied back by weight_i
        self.weights = self.norms if normalize else torch.ones_like(self.norms)
        self.total = float(self.n) if normalize else float((self.norms**2).sum())  # sum_i ||Delta_i||^2 as fitted
        self.Q_B, self.Bt = _reduce(Bt, R)
        self.Q_A, self.A = _reduce(A, R)

    def lift(self, U: torch.Tensor, V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        U = U if self.Q_B is None else self.Q_B @ U
        V = V if self.Q_A is None else self.Q_A @ V
        return U, V

    def project(self, U: torch.Tensor, V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        U = U.to(self.device, _DTYPE)
        V = V.to(self.device, _DTYPE)
        U = U if self.Q_B is None else self.Q_B.T @ U
        V = V if self.Q_A is None else self.Q_A.T @ V
        return U, V

    def best_core_errors(self, U: torch.Tensor, V: torch.Tensor, method: str) -> torch.Tensor:
        """Squared relative error of every adapter under given bases and its least-squares core: [n].

        JD-Full (U, V orthonormal): ``1 - ||U^T Delta_i V||^2 / ||Delta_i||^2``.
        JD-Diag: ``1 - z_i^T H^+ z_i / ||Delta_i||^2`` with z_i, H as in :func:`jd_diag`.
        Expanded through Gram terms, so accurate to round-off of ||Delta_i||^2
        only: good for choosing among bases (clustering), not for reporting
        (:func:`relative_errors` is exact).
        """
        U, V = U.to(self.device, _DTYPE), V.to(self.device, _DTYPE)
        Ur, Vr = self.project(U, V)
        if method == "jd-full":
            captured = torch.bmm(self.right(Ur).transpose(1, 2), self.left(Vr)).square().sum(dim=(1, 2))
        elif method == "jd-diag":
            Z = (self.right(Ur) * self.left(Vr)).sum(dim=1)
            captured = ((Z @ _pinv_psd((U.T @ U) * (V.T @ V))) * Z).sum(dim=1)
        else:
            raise CompressError("E_COMPRESS_METHOD", f"method must be one of {METHODS}, got {method!r}")
        fitted = self.norms.square() / self.weights.square()  # ||Delta_i||^2 in fitted units
        safe = torch.where(fitted > 0, fitted, torch.ones_like(fitted))
        return torch.where(fitted > 0, (fitted - captured).clamp(min=0) / safe, torch.zeros_like(fitted))

    def left(self, V: torch.Tensor) -> torch.Tensor:
        """``A_i V`` for every i: [n, r, R]."""
        return _rows_times(self.A, V)

    def right(self, U: torch.Tensor) -> torch.Tensor:
        """``B_i^T U`` for every i: [n, r, R]."""
        return _rows_times(self.Bt, U)


def _padded_factors(factors, r: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``Bt_i = (s_i B_i)^T`` [n, r, d_out] and ``A_i`` [n, r, d_in], float64 on ``device``, ranks zero-padded to r.

    One stack and one conversion per factor side, not a copy per adapter;
    the values are those of converting each factor to float64 and scaling it.
    """
    scales = torch.tensor([float(f.scale) for f in factors], dtype=_DTYPE, device=device)
    Bt = _padded_rows([f.B.T for f in factors], r, device) * scales[:, None, None]
    return Bt, _padded_rows([f.A for f in factors], r, device)


def _padded_rows(mats, r: int, device) -> torch.Tensor:
    """[n, r, d] float64 on ``device`` from [r_i, d] matrices, each padded with zero rows to r."""
    rows = [m.to(device) if m.shape[0] == r else pad(m.to(device), (0, 0, 0, r - m.shape[0])) for m in mats]
    return torch.stack(rows).to(dtype=_DTYPE)


def _rows_times(F: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    # one 2-D GEMM: batched broadcast matmul is far slower on small CPU shapes
    n, r, rho = F.shape
    return (F.reshape(n * r, rho) @ X).reshape(n, r, X.shape[1])


def _stack_t(F: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """``sum_i F_i^T G_i`` for F [n, r, p], G [n, r, q]: one GEMM over the stacked rows."""
    n, r, p = F.shape
    return F.reshape(n * r, p).T @ G.reshape(n * r, G.shape[2])


def orthonormal_columns(X: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns Q [m, k] whose span contains the range of a tall-skinny X [m, k] (m >= k).

    CholeskyQR2: ``Q = X R^-1`` with ``R^T R = X^T X`` (Cholesky), applied
    twice, the second pass restoring the orthogonality the first loses to
    X's conditioning: two GEMMs and a k x k Cholesky per pass, on a GPU far
    cheaper than a Householder QR of the block. ``R`` is invertible, so Q
    spans exactly range(X); it is the Q of the QR with positive diagonal
    (Householder's may differ in column signs). Where a Cholesky breaks
    down (rank-deficient or ill-conditioned X, about cond > 1e8 in float64,
    e.g. zero columns) or ``max |Q^T Q - I|`` exceeds ``_ORTHONORMAL_ULPS``
    ulps, the CholeskyQR2 output is discarded for Householder QR's Q, which
    is orthonormal whatever the rank of X (its extra columns then span
    directions outside range(X)). Deterministic: the same X gives the same Q.
    """
    Q, failed = X, torch.zeros((), dtype=torch.bool, device=X.device)
    for _ in range(2):
        L, info = torch.linalg.cholesky_ex(Q.T @ Q)
        Q = torch.linalg.solve_triangular(L.T, Q, upper=True, left=False)
        failed = failed | (info != 0)
    eye = torch.eye(X.shape[1], dtype=X.dtype, device=X.device)
    worst = (Q.T @ Q - eye).abs().amax()
    if bool(failed | ~(worst <= _ORTHONORMAL_ULPS * torch.finfo(X.dtype).eps)):  # NaN counts as failed
        return torch.linalg.qr(X, mode="reduced")[0]
    return Q


def check_factors(factors) -> None:
    """Raise ``E_COMPRESS_SHAPE`` unless every factor pair is ``A [r, d_in]``, ``B [d_out, r]`` of one module shape."""
    if len(factors) == 0:
        raise CompressError("E_COMPRESS_EMPTY", "a collection needs at least one adapter")
    d_in = d_out = None
    for i, f in enumerate(factors):
        if not isinstance(f, FactoredDelta):
            raise CompressError("E_COMPRESS_SHAPE", f"adapter {i}: expected a FactoredDelta, got {type(f).__name__}")
        if f.A.dim() != 2 or f.B.dim() != 2 or f.A.shape[0] != f.B.shape[1] or f.A.shape[0] < 1:
            raise CompressError(
                "E_COMPRESS_SHAPE",
                f"adapter {i}: A {tuple(f.A.shape)} and B {tuple(f.B.shape)} are not [r, d_in] and [d_out, r]",
            )
        if d_in is None:
            d_in, d_out = int(f.A.shape[1]), int(f.B.shape[0])
        elif (int(f.A.shape[1]), int(f.B.shape[0])) != (d_in, d_out):
            raise CompressError(
                "E_COMPRESS_SHAPE",
                f"adapter {i}: Delta is {int(f.B.shape[0])}x{int(f.A.shape[1])}, the collection's is {d_out}x{d_in}",
            )


def _reduce(F: torch.Tensor, R: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Orthonormal basis Q [d, rho] of the row space of ``[F_1; ...; F_n]`` (F: [n, r, d]) and ``F_i Q``.

    Zero columns pad the stack to at least R so that Q always has R
    orthonormal columns to choose a basis from (:func:`orthonormal_columns`
    returns an orthonormal Q whatever the rank of its input).
    """
    n, r, d = F.shape
    width = max(n * r, R)
    if width >= d:
        return None, F
    stacked = F.reshape(n * r, d).T
    if width > n * r:
        stacked = torch.cat([stacked, stacked.new_zeros(d, width - n * r)], dim=1)
    Q = orthonormal_columns(stacked)
    return Q, _rows_times(F, Q)


def _factored_norms(Bt: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """``||Bt_i^T A_i||_F`` for every i (Bt [n, r, d_out], A [n, r, d_in]), never forming the product.

    First from the r x r Gram matrices, ``||B A||^2 = sum((B^T B) * (A A^T))``
    (two batched GEMMs). Its relative error is about ``rho^2 eps`` with
    ``rho^2 = ||B||^2 ||A||^2 / ||B A||^2`` (at least 1, at most about
    ``r cond(A)^2``; about r for well-conditioned factors), against about
    ``rho eps`` for the triangular factors of QR (``B = Q_B R_B``,
    ``A^T = Q_A R_A``, ``||B A|| = ||R_B R_A^T||``). Entries with ``rho^2``
    above ``_GRAM_NORM_MAX_RHO2`` (ill-conditioned factors, or a product
    that cancels to zero) are recomputed through QR, so every norm keeps its
    relative accuracy to within about ``_GRAM_NORM_MAX_RHO2`` ulps. A zero
    factor gives exactly 0.
    """
    GB = torch.bmm(Bt, Bt.transpose(1, 2))
    GA = torch.bmm(A, A.transpose(1, 2))
    squared = (GB * GA).sum(dim=(1, 2)).clamp(min=0)
    spread = GB.diagonal(dim1=1, dim2=2).sum(dim=1) * GA.diagonal(dim1=1, dim2=2).sum(dim=1)  # ||B||^2 ||A||^2
    norms = squared.sqrt()
    doubtful = (spread > _GRAM_NORM_MAX_RHO2 * squared).nonzero().flatten()
    if doubtful.numel():
        norms[doubtful] = torch.linalg.matrix_norm(
            _small_product(Bt[doubtful].transpose(1, 2), A[doubtful].transpose(1, 2))
        )
    return norms


def _small_product(X: torch.Tensor, Yt: torch.Tensor) -> torch.Tensor:
    """``R_X R_Y^T`` with ``X = Q_X R_X``, ``Y^T = Q_Y R_Y``: same singular values as ``X Y`` (batched)."""
    _, RX = torch.linalg.qr(X, mode="reduced")
    _, RY = torch.linalg.qr(Yt, mode="reduced")
    return RX @ RY.transpose(-1, -2)


def _sandwich(F: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """``sum_i F_i^T G_i F_i`` for F [n, r, rho], G [n, r, r]: one rho x rho matrix, no per-adapter product."""
    return _stack_t(F, torch.bmm(G, F))


def _top_eigvecs(M: torch.Tensor, R: int) -> torch.Tensor:
    """The R leading eigenvectors of a symmetric PSD matrix, largest eigenvalue first."""
    _, vecs = torch.linalg.eigh((M + M.T) / 2)
    return vecs[:, -R:].flip(1)


# Above this reduced dimension (and above 4R) JD-Full's eigenspaces come from
# block Krylov + Rayleigh-Ritz instead of a dense eigh: rho^3 eigh per
# half-step dominates a 4096-wide module, the Krylov step costs a few GEMMs.
EXACT_EIGH_MAX = 512
EIGENSOLVERS = ("auto", "eigh", "krylov")
_KRYLOV_STEPS = 2  # per half-step, warm-started from the previous basis
_KRYLOV_INIT_STEPS = 6  # from a seeded random block, for the HOSVD start


def _leading_subspace(F: torch.Tensor, G: torch.Tensor, R: int, exact: bool, warm, gen) -> torch.Tensor:
    """Orthonormal R leading eigenvectors of ``M = sum_i F_i^T G_i F_i`` (F [n, r, rho], G [n, r, r] PSD).

    ``exact``: a dense eigh of M. Otherwise M is never formed: Rayleigh-Ritz
    on the block Krylov space ``[X, M X, M^2 X]`` of the previous basis X
    (or of a seeded random block, with more steps, when there is none).
    That space contains X, so the new basis captures at least X's energy:
    JD-Full's objective stays monotone, and its fixed points are those of the
    exact update (a basis reproduced by Rayleigh-Ritz spans an invariant
    subspace of M).
    """
    if exact:
        return _top_eigvecs(_sandwich(F, G), R)

    def apply(X):
        return _stack_t(F, torch.bmm(G, _rows_times(F, X)))

    steps = _KRYLOV_STEPS
    if warm is None:
        warm = torch.randn(F.shape[2], R, generator=gen, dtype=_DTYPE).to(F.device)
        steps = _KRYLOV_INIT_STEPS
    blocks = [orthonormal_columns(warm)]
    for _ in range(steps):
        Y = apply(blocks[-1])
        basis = torch.cat(blocks, dim=1)
        for _ in range(2):  # "twice is enough" re-orthogonalisation
            Y = Y - basis @ (basis.T @ Y)
        blocks.append(orthonormal_columns(Y))
    basis = orthonormal_columns(torch.cat(blocks, dim=1)[:, : F.shape[2]])
    return basis @ _top_eigvecs(basis.T @ apply(basis), R)


def _dense_ok(rho: int, R: int) -> bool:
    return rho <= max(EXACT_EIGH_MAX, 4 * R)


def _random_orthonormal(rows: int, R: int, gen: torch.Generator, device) -> torch.Tensor:
    return orthonormal_columns(torch.randn(rows, R, generator=gen, dtype=_DTYPE)).to(device)


def _check_init(init, col: FactoredCollection, R: int):
    if isinstance(init, str):
        if init not in ("svd", "random"):
            raise CompressError("E_COMPRESS_INIT", f"init must be 'svd', 'random' or a (U, V) pair, got {init!r}")
        return init
    U, V = init
    if tuple(U.shape) != (col.d_out, R) or tuple(V.shape) != (col.d_in, R):
        raise CompressError(
            "E_COMPRESS_INIT",
            f"init bases U {tuple(U.shape)}, V {tuple(V.shape)}; expected ({col.d_out}, {R}), ({col.d_in}, {R})",
        )
    return col.project(U, V)


def _svd_init(col: FactoredCollection, R: int, gen: torch.Generator, exact: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """HOSVD start, TensorLy's ``init='svd'``: leading eigenvectors of ``sum_i Delta_i Delta_i^T`` and ``sum_i Delta_i^T Delta_i``.

    Where R exceeds a reduced dimension (JD-Diag only) the extra columns are seeded random.
    """
    # sum_i B_i (A_i A_i^T) B_i^T and sum_i A_i^T (B_i^T B_i) A_i, through r x r Grams
    GA = torch.bmm(col.A, col.A.transpose(1, 2))
    GB = torch.bmm(col.Bt, col.Bt.transpose(1, 2))
    if not exact:
        return _leading_subspace(col.Bt, GA, R, False, None, gen), _leading_subspace(col.A, GB, R, False, None, gen)
    return _leading_or_random(_sandwich(col.Bt, GA), R, gen), _leading_or_random(_sandwich(col.A, GB), R, gen)


def _leading_or_random(M: torch.Tensor, R: int, gen: torch.Generator) -> torch.Tensor:
    rows = M.shape[0]
    if R <= rows:
        return _top_eigvecs(M, R)
    extra = torch.randn(rows, R - rows, generator=gen, dtype=_DTYPE).to(M.device)
    return torch.cat([_top_eigvecs(M, rows), extra / math.sqrt(rows)], dim=1)


def _converged(previous: float, current: float, tol: float, total: float) -> bool:
    # The objective is ||Delta||^2 minus captured energy: changes below the
    # round-off of that subtraction are noise, whatever tol asks.
    return current <= _EXACT_FLOOR * total or abs(previous - current) <= max(tol * previous, _EXACT_FLOOR * total)


# ---------------------------------------------------------------- JD-Full


def _full_objective(col: FactoredCollection, U: torch.Tensor, V: torch.Tensor) -> float:
    captured = torch.bmm(col.right(U).transpose(1, 2), col.left(V)).square().sum()
    return max(col.total - float(captured), 0.0)


def jd_full(
    factors,
    R: int,
    *,
    iters: int = 10,
    tol: float = 1e-6,
    normalize: bool = True,
    seed: int = 0,
    init="svd",
    eigensolver: str = "auto",
    device="cpu",
) -> JDResult:
    """JD-Full: orthonormal shared bases and full R x R cores.

    Minimises ``sum_i w_i^-2 ||Delta_i - U Sigma_i V^T||_F^2`` over
    ``U^T U = V^T V = I_R`` (``w_i = ||Delta_i||_F`` when ``normalize``, else 1).
    For fixed bases the optimal core is ``Sigma_i = U^T Delta_i V``, which
    turns the fit into maximising the captured energy ``sum_i ||U^T Delta_i V||^2``.
    Alternating (TensorLy's Tucker-2 HOOI over the adapter-stacked tensor)::

        U <- top-R eigenvectors of M(V) = sum_i B_i (A_i V)(A_i V)^T B_i^T
        V <- top-R eigenvectors of N(U) = sum_i A_i^T (B_i^T U)(B_i^T U)^T A_i
        Sigma_i = (U^T B_i)(A_i V) * w_i        (norms restored)

    Each half-step maximises the captured energy over one basis, so the
    objective never increases. Stops after ``iters`` sweeps or when the
    objective's relative change is at most ``tol`` (or it reaches the float64
    round-off floor). ``init`` is ``"svd"`` (HOSVD), ``"random"`` (seeded) or
    a ``(U, V)`` pair to warm-start from. ``R <= min(d_in, d_out)``.

    ``eigensolver``: ``"eigh"`` takes each top-R eigenspace from a dense
    eigh of M (or N) in the reduced dimension rho; ``"krylov"`` from block
    Krylov + Rayleigh-Ritz warm-started at the previous basis, never forming
    M (still monotone, same fixed points, more sweeps to converge; see
    ``_leading_subspace``); ``"auto"``: eigh while ``rho <=
    max(EXACT_EIGH_MAX, 4 R)``, Krylov above.
    """
    check_factors(factors)
    d_in, d_out = int(factors[0].A.shape[1]), int(factors[0].B.shape[0])
    if R > min(d_in, d_out):
        raise CompressError("E_COMPRESS_RANK", f"JD-Full needs R <= min(d_in, d_out) = {min(d_in, d_out)}, got {R}")
    if eigensolver not in EIGENSOLVERS:
        raise CompressError("E_COMPRESS_EIGENSOLVER", f"eigensolver must be one of {EIGENSOLVERS}, got {eigensolver!r}")
    col = FactoredCollection(factors, R, normalize, device)
    gen = torch.Generator().manual_seed(seed)
    exact_u, exact_v = (
        eigensolver == "eigh" or (eigensolver == "auto" and _dense_ok(rho, R)) for rho in (col.Bt.shape[2], col.A.shape[2])
    )
    start = _check_init(init, col, R)
    if start == "svd":
        U, V = _svd_init(col, R, gen, exact=exact_u and exact_v)
    elif start == "random":
        U = _random_orthonormal(col.Bt.shape[2], R, gen, col.device)
        V = _random_orthonormal(col.A.shape[2], R, gen, col.device)
    else:
        # a warm start is only a starting point: re-orthonormalise in reduced coordinates
        U, V = (orthonormal_columns(X) for X in start)
    history = [_full_objective(col, U, V)]
    converged = history[0] <= _EXACT_FLOOR * col.total
    sweeps = 0
    while not converged and sweeps < iters:
        C = col.left(V)
        U = _leading_subspace(col.Bt, torch.bmm(C, C.transpose(1, 2)), R, exact_u, U, gen)
        D = col.right(U)
        V = _leading_subspace(col.A, torch.bmm(D, D.transpose(1, 2)), R, exact_v, V, gen)
        sweeps += 1
        history.append(_full_objective(col, U, V))
        converged = _converged(history[-2], history[-1], tol, col.total)
    cores = torch.bmm(col.right(U).transpose(1, 2), col.left(V)) * col.weights[:, None, None]
    U, V = col.lift(U, V)
    return JDResult("jd-full", U, V, cores, col.norms, normalize, sweeps, converged, seed, history)


# ---------------------------------------------------------------- JD-Diag


def _pinv_psd(H: torch.Tensor) -> torch.Tensor:
    return torch.linalg.pinv((H + H.T) / 2, hermitian=True)


def _diag_terms(col: FactoredCollection, U: torch.Tensor, V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Z[i, j] = u_j^T Delta_i v_j = sum_k (B_i^T U)[k, j] (A_i V)[k, j]`` and ``H = U^T U * V^T V``."""
    return (col.right(U) * col.left(V)).sum(dim=1), (U.T @ U) * (V.T @ V)


def _diag_cores(col: FactoredCollection, U: torch.Tensor, V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Least-squares diagonal cores for fixed bases, ``D = Z H^+``; returns ``(D, Z, H)``."""
    Z, H = _diag_terms(col, U, V)
    return Z @ _pinv_psd(H), Z, H


def _diag_objective(col: FactoredCollection, D: torch.Tensor, Z: torch.Tensor, H: torch.Tensor) -> float:
    value = col.total - 2 * float((D * Z).sum()) + float(((D @ H) * D).sum())
    return max(value, 0.0)


def jd_diag(
    factors,
    R: int,
    *,
    iters: int = 10,
    tol: float = 1e-6,
    normalize: bool = True,
    seed: int = 0,
    init="svd",
    restarts: int = 0,
    device="cpu",
) -> JDResult:
    """JD-Diag: unconstrained shared bases and diagonal cores.

    Minimises ``sum_i w_i^-2 ||Delta_i - U diag(d_i) V^T||_F^2``: a CP
    decomposition of rank R of the adapter-stacked tensor with factors U, V
    and ``D = [d_1; ...; d_n]`` [n, R]. Alternating least squares, each step
    the exact minimiser of its block (Hadamard-Gram normal equations, ``*`` is
    the elementwise product, ``^+`` the pseudo-inverse)::

        U <- (sum_i B_i (A_i V) diag(d_i))     ((V^T V) * (D^T D))^+
        V <- (sum_i A_i^T (B_i^T U) diag(d_i)) ((U^T U) * (D^T D))^+
        D <- Z ((U^T U) * (V^T V))^+,  Z[i, j] = u_j^T Delta_i v_j
        rescale: u_j /= |u_j|, v_j /= |v_j|, D[:, j] *= |u_j| |v_j|

    The rescaling changes no product ``U diag(d_i) V^T``; it keeps the
    columns of U and V at unit norm so that the scale lives in the cores and
    the Gram matrices stay balanced. The objective never increases.

    ``init``: ``"svd"`` starts from the HOSVD bases (the leading
    eigenvectors of ``sum_i Delta_i Delta_i^T`` and ``sum_i Delta_i^T
    Delta_i``, Krylov on wide modules, as in :func:`jd_full`; seeded random
    columns where R exceeds their rank), ``"random"`` from seeded random
    bases, a ``(U, V)`` pair from those bases; every start takes the
    least-squares cores of its bases first (the adapter mode first, as
    PARAFAC orders its blocks), then the sweeps above. ALS can stall in a
    swamp from any one start: ``restarts`` adds that many fits from seeded
    random starts and keeps the lowest final objective. Cores returned with
    norms restored when ``normalize``.
    """
    check_factors(factors)
    col = FactoredCollection(factors, R, normalize, device)
    gen = torch.Generator().manual_seed(seed)
    start = _check_init(init, col, R)
    best = _diag_als(col, R, start, iters, tol, gen)
    for _ in range(restarts):
        candidate = _diag_als(col, R, "random", iters, tol, gen)
        if candidate[3][-1] < best[3][-1]:
            best = candidate
    U, V, D, history, sweeps, converged = best
    U, V = col.lift(U, V)
    return JDResult("jd-diag", U, V, D * col.weights[:, None], col.norms, normalize, sweeps, converged, seed, history)


def _diag_als(col: FactoredCollection, R: int, start, iters: int, tol: float, gen: torch.Generator):
    if start == "svd":
        U, V = _svd_init(col, R, gen, exact=_dense_ok(col.Bt.shape[2], R) and _dense_ok(col.A.shape[2], R))
    elif start == "random":
        U = torch.randn(col.Bt.shape[2], R, generator=gen, dtype=_DTYPE).to(col.device)
        V = torch.randn(col.A.shape[2], R, generator=gen, dtype=_DTYPE).to(col.device)
    else:
        U, V = start
    D = _diag_cores(col, U, V)[0]  # cores first: the least-squares cores of the starting bases
    history = [_diag_objective(col, D, *_diag_terms(col, U, V))]
    converged = history[0] <= _EXACT_FLOOR * col.total
    sweeps = 0
    while not converged and sweeps < iters:
        DtD = D.T @ D
        U = _stack_t(col.Bt, col.left(V) * D[:, None, :]) @ _pinv_psd((V.T @ V) * DtD)
        V = _stack_t(col.A, col.right(U) * D[:, None, :]) @ _pinv_psd((U.T @ U) * DtD)
        U, V = _unit_columns(U), _unit_columns(V)
        D, Z, H = _diag_cores(col, U, V)
        sweeps += 1
        history.append(_diag_objective(col, D, Z, H))
        converged = _converged(history[-2], history[-1], tol, col.total)
    return U, V, D, history, sweeps, converged


def _unit_columns(X: torch.Tensor) -> torch.Tensor:
    # the core step that follows absorbs the scale, so dividing here is the rescaling step
    norms = torch.linalg.vector_norm(X, dim=0)
    return X / torch.where(norms > 0, norms, torch.ones_like(norms))


# ---------------------------------------------------------------- errors


def squared_errors(factors, result: JDResult, *, chunk: int = 64) -> list[float]:
    """``||Delta_i - U Sigma_i V^T||_F^2`` per adapter, exactly, in factored form.

    With ``U = Q T`` (Householder QR, Q orthonormal) the residual splits into
    two parts with orthogonal column spaces, ``Q (Q^T Delta_i - T Sigma_i V^T)``
    and ``(I - Q Q^T) Delta_i = P_i A_i`` with ``P_i = s_i B_i - Q C_i``,
    ``C_i = Q^T s_i B_i`` [R, r]; so the squared error is
    ``||C_i A_i - T Sigma_i V^T||^2 + ||P_i A_i||^2``. The first is formed
    directly ([R, d_in] per adapter: the update and its fit cancel entry by
    entry, as in a dense residual); the second by :func:`_factored_norms`
    after the projection has removed what U captures, so its round-off is
    relative to ``||P_i A_i||`` itself. Unlike expanding the square into
    traces of Gram matrices this keeps full relative accuracy when the
    residual is tiny. Adapters are taken ``chunk`` at a time (memory
    O(chunk (r + R) max(d_in, d_out))).
    """
    check_factors(factors)
    if len(factors) != result.cores.shape[0]:
        raise CompressError("E_COMPRESS_SHAPE", f"{len(factors)} adapters but {result.cores.shape[0]} cores")
    U, V, cores = result.U, result.V, result.full_cores()
    Q, T = torch.linalg.qr(U, mode="reduced")
    out: list[float] = []
    for lo in range(0, len(factors), chunk):
        part = factors[lo : lo + chunk]
        Bt, A = _padded_factors(part, max(f.rank for f in part), U.device)
        C = Bt @ Q  # C_i^T, [c, r, R]
        inside = torch.bmm(C.transpose(1, 2), A) - (T @ cores[lo : lo + len(part)]) @ V.T
        outside = _factored_norms(Bt - C @ Q.T, A)
        out.extend((inside.square().sum(dim=(1, 2)) + outside.square()).tolist())
    return out


def relative_errors(factors, result: JDResult) -> list[float]:
    """Squared relative Frobenius error ``||Delta_i - U Sigma_i V^T||^2 / ||Delta_i||^2`` per adapter.

    A zero update reconstructed exactly counts 0.0, reconstructed with anything
    else ``inf``.
    """
    absolute = squared_errors(factors, result)
    norms = result.norms.tolist()
    out = []
    for e, w in zip(absolute, norms):
        if w > 0:
            out.append(e / (w * w))
        else:
            out.append(0.0 if e == 0.0 else math.inf)
    return out
