"""Parameter ledger and break-even collection size of a joint representation.

Owns integer accounting only: how many parameters the shared bases and the
per-adapter cores take against the uncompressed ``r_i (d_in + d_out)`` per
adapter, and the smallest collection size at which a representation saves
parameters. Plain ints and Fractions, so the counts compare exactly;
no tensors, no floats.

Per module, with ``S = d_in + d_out``, k clusters of shared rank R and n adapters::

    P_LoRA            = S * sum_i r_i                 (= n r0 S at one rank r0)
    P_payload         = k R S + n c,   c = R^2 (JD-Full) or R (JD-Diag)
    P_paper           = P_payload + n  (one cluster assignment per adapter)
    break-even        n (r0 S - c) > k R S,  i.e. n_min = floor(k R S / (r0 S - c)) + 1

With mixed source ranks r0 is the collection's mean rank ``sum_i r_i / n`` (a
Fraction): the inequality is then exact for this collection and for any
larger one of the same mean rank. A non-positive denominator means no
collection size saves parameters under this count (``break_even_n is None``).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from mlora.compress.solvers import METHODS, CompressError

FP16_BYTES = 2


def core_params(method: str, R: int) -> int:
    """Per-adapter core parameters: ``R^2`` for JD-Full, ``R`` for JD-Diag."""
    if method not in METHODS:
        raise CompressError("E_COMPRESS_METHOD", f"method must be one of {METHODS}, got {method!r}")
    return R * R if method == "jd-full" else R


def break_even_n(shared_params: int, saving_per_adapter: Fraction | int) -> int | None:
    """Smallest integer n with ``n * saving_per_adapter > shared_params``; None when the saving is not positive."""
    saving = Fraction(saving_per_adapter)
    if saving <= 0:
        return None
    return int(Fraction(shared_params) / saving) + 1  # floor(...) + 1: the inequality is strict


@dataclass(frozen=True)
class ModuleLedger:
    """One adapted matrix shape: the counts of the module docstring for one collection."""

    method: str
    d_in: int
    d_out: int
    R: int
    clusters: int
    n: int
    lora_params: int  # S * sum_i r_i
    shared_params: int  # k R S
    core_params: int  # n R^2 or n R
    payload_params: int  # shared + cores
    paper_params: int  # payload + n assignments
    mean_source_rank: Fraction  # r0
    break_even_n: int | None  # smallest n that saves parameters; None: none does

    @property
    def S(self) -> int:
        return self.d_in + self.d_out

    @property
    def saves(self) -> bool:
        """Whether this collection's joint payload is smaller than its LoRA factors."""
        return self.payload_params < self.lora_params

    def fp16_bytes(self) -> dict[str, int]:
        return {"lora": FP16_BYTES * self.lora_params, "payload": FP16_BYTES * self.payload_params}


def module_ledger(d_in: int, d_out: int, source_ranks, R: int, method: str, clusters: int = 1) -> ModuleLedger:
    """The ledger of one module for n adapters of ``source_ranks`` (module docstring)."""
    ranks = [int(r) for r in source_ranks]
    if not ranks:
        raise CompressError("E_COMPRESS_EMPTY", "a ledger needs at least one adapter")
    if R < 1 or clusters < 1 or min(ranks) < 1 or d_in < 1 or d_out < 1:
        raise CompressError(
            "E_COMPRESS_RANK", f"ranks, R={R}, clusters={clusters} and dimensions must all be positive"
        )
    n, S, c = len(ranks), d_in + d_out, core_params(method, R)
    shared = clusters * R * S
    r0 = Fraction(sum(ranks), n)
    return ModuleLedger(
        method=method,
        d_in=d_in,
        d_out=d_out,
        R=R,
        clusters=clusters,
        n=n,
        lora_params=S * sum(ranks),
        shared_params=shared,
        core_params=n * c,
        payload_params=shared + n * c,
        paper_params=shared + n * c + n,
        mean_source_rank=r0,
        break_even_n=break_even_n(shared, r0 * S - c),
    )


@dataclass(frozen=True)
class LedgerTotals:
    """A full-model count: every module's bases and cores summed."""

    modules: int
    n: int
    lora_params: int
    shared_params: int
    core_params: int
    payload_params: int
    paper_params: int
    break_even_n: int | None  # n (sum of per-adapter savings) > sum of shared parameters

    @property
    def saves(self) -> bool:
        return self.payload_params < self.lora_params


def total_ledger(modules) -> LedgerTotals:
    """Sum module ledgers of one collection; the break-even n is that of the summed inequality."""
    modules = list(modules)
    if not modules:
        raise CompressError("E_COMPRESS_EMPTY", "a total needs at least one module ledger")
    ns = {m.n for m in modules}
    if len(ns) != 1:
        raise CompressError("E_COMPRESS_SHAPE", f"module ledgers count different collections: n in {sorted(ns)}")
    shared = sum(m.shared_params for m in modules)
    saving = sum(m.mean_source_rank * m.S - core_params(m.method, m.R) for m in modules)
    return LedgerTotals(
        modules=len(modules),
        n=ns.pop(),
        lora_params=sum(m.lora_params for m in modules),
        shared_params=shared,
        core_params=sum(m.core_params for m in modules),
        payload_params=sum(m.payload_params for m in modules),
        paper_params=sum(m.paper_params for m in modules),  # clusters are per module: one assignment each
        break_even_n=break_even_n(shared, saving),
    )
