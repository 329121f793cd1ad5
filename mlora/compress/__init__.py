"""Compress-then-Serve: one adapter collection as shared bases plus small per-adapter cores
(docs/design.md, Bundle and three-stage operator; docs/compress.md).

Owns the offline approximation of a collection of LoRA updates
``Delta_i = s_i B_i A_i`` at one module by ``U Sigma_i V^T``:

* :mod:`.solvers` - JD-Full (orthonormal bases, R x R cores) and JD-Diag
  (unconstrained bases, diagonal cores) fitted in factored form, and exact
  per-adapter reconstruction errors;
* :mod:`.cluster` - k clusters with their own bases: k-means start, then
  alternating refits and lowest-error reassignment; the smallest K meeting
  an error bound;
* :mod:`.ledger` - parameter counts and break-even collection size;
* :mod:`.operator` - the reference three-stage runtime product;
* :mod:`.collection` - adapter directories (validated with ``mlora.lora_tools``)
  as ``{module: {member: FactoredDelta}}``, failing closed on any bad member;
* :mod:`.bundle` - the whole-collection pipeline behind ``mlora compress``
  (per-module fits, the ``--max-error`` gate, immutable bundles with
  collection identity, verified reading, export of a member as PEFT).

Imports torch, ``mlora.lora_tools`` (collection loading, digests) and itself;
``mlora.batch.adapters`` serves bundle members in ``batch-run``.
"""

from mlora.compress.cluster import ClusterResult, auto_clusters, cluster, kmeans
from mlora.compress.ledger import LedgerTotals, ModuleLedger, break_even_n, module_ledger, total_ledger
from mlora.compress.operator import joint_apply
from mlora.compress.solvers import (
    EIGENSOLVERS,
    METHODS,
    CompressError,
    FactoredCollection,
    FactoredDelta,
    JDResult,
    jd_diag,
    jd_full,
    relative_errors,
    squared_errors,
)

__all__ = [
    "EIGENSOLVERS",
    "METHODS",
    "ClusterResult",
    "CompressError",
    "FactoredCollection",
    "FactoredDelta",
    "JDResult",
    "LedgerTotals",
    "ModuleLedger",
    "auto_clusters",
    "break_even_n",
    "cluster",
    "jd_diag",
    "jd_full",
    "joint_apply",
    "kmeans",
    "module_ledger",
    "relative_errors",
    "squared_errors",
    "total_ledger",
]
