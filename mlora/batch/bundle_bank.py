"""Serving a collection bundle with the three-stage operator (spec 0x06G4).

Owns the device copies of one bundle's shared bases and per-member cores and
the LoraContext that applies them. Must not read bundle files itself (the
bundle verified at pin time, ``mlora.batch.bundles``, hands its tensors over)
nor know the model's layer code (``mlora.batch.lora`` is the seam).

For module ``m`` (one (layer, role)) with K clusters of shared rank R, member
``i`` in cluster ``c = a_m(i)`` stands for ``Delta_i = U_c core_i V_c^T``. For
every packed row ``t`` of member ``i`` (``i = -1``: the base model)::

    H_t   = x_t @ [V_0 | V_1 | ... | V_{K-1}]             [K*R]  shared projections
    h_t   = H_t[c*R : (c+1)*R]                            [R]    the row's cluster
    h_t   = core_i @ h_t   (JD-Full)  |  core_i * h_t (JD-Diag)       per-member core
    y_t  += [U_0 | ... | U_{K-1}] @ onehot_c(h_t)         [d_out] shared expansion

which is ``y_t += x_t Delta_i^T``. Rows of the base model, and rows whose
member does not adapt a module, are left bit-identical (``torch.where``, not
``+ 0``). The projection is computed for every cluster at once (dense, static
shapes): K*R extra columns cost little next to the base GEMM, and no shape
depends on the batch's data, so an invocation needs no host synchronisation
and can be captured in a CUDA graph (the LoRA inputs are one ``row_member``
vector, refilled per replay).

Residency (spec 0x06G9): the bases and every member's core are loaded once,
when the job starts, and stay resident for the whole job: a basis is never
evicted while a member is in flight because nothing is ever evicted, and a
core is only ever used with the basis generation it was fitted with (both
come from the one verified bundle). Device memory is therefore the bundle's
parameter count (:meth:`BundleBank.bytes_needed`); the job refuses a bundle
larger than the adapters' share of GPU memory at start (``E_BUNDLE_TOO_LARGE``,
``mlora.batch.session``) rather than serving it partially. Not built yet: per-cluster eviction of bases and cores under a
memory budget, and a Triton path (this one runs dense torch GEMMs on either
device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .bank import BankError, BankStats
from .catalog import PinnedAdapter
from .lora import GROUPS, ROLE_SLICE


@dataclass
class _Module:
    """Device tensors of one (layer, role): ``V`` [d_in, K*R], ``Ut`` [K*R, d_out],
    ``cores`` [M+1, R, R] (JD-Full) or [M+1, R] (JD-Diag) with row M all zero,
    ``cluster`` int64 [M+1] (member -> cluster, 0 for M), ``adapts`` bool [M+1]."""

    V: torch.Tensor
    Ut: torch.Tensor
    cores: torch.Tensor
    cluster: torch.Tensor
    adapts: torch.Tensor
    K: int
    R: int


class BundleBank:
    """All members of one bundle resident, each member a "slot" (its index in the
    bundle's member order). Implements the bank protocol the engine uses:
    ``ensure``, ``context``, ``resident``, ``stats``, ``num_slots``, ``max_rank``."""

    error = BankError

    def __init__(self, bundle, num_layers: int, shapes: dict[str, tuple[int, tuple[int, ...]]], dtype: torch.dtype,
                 device, pinned: dict[str, PinnedAdapter] | None = None):
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_layers = num_layers
        self.bundle_sha256 = bundle.manifest["bundle_sha256"]
        self.method = bundle.method
        self.members = bundle.member_ids()
        self.index = {m: i for i, m in enumerate(self.members)}
        self.num_slots = len(self.members)
        self.max_rank = int(bundle.manifest["options"]["rank"])
        self.groups = tuple(g for g in GROUPS if g in shapes)
        self.widths = {g: tuple(int(w) for w in shapes[g][1]) for g in self.groups}
        self.offsets = {g: [sum(self.widths[g][:j]) for j in range(len(self.widths[g]))] for g in self.groups}
        self.stats = BankStats()
        self.modules: dict[tuple[int, str], _Module] = {}
        M = self.num_slots
        for name, mod in bundle.manifest["modules"].items():
            parts = name.split(".")
            layer, role = int(parts[2]), parts[-1]
            group, j = ROLE_SLICE[role]
            if group not in self.widths or not 0 <= layer < num_layers:
                raise BankError("E_BANK_SHAPE", f"bundle module {name} does not fit the model")
            d_out, d_in = self.widths[group][j], int(shapes[group][0])
            if (int(mod["d_out"]), int(mod["d_in"])) != (d_out, d_in):
                raise BankError("E_BANK_SHAPE", f"bundle module {name} is [{mod['d_out']}, {mod['d_in']}], the model "
                                f"has [{d_out}, {d_in}]")
            K, R = int(mod["clusters"]), self.max_rank
            V = torch.cat([bundle.bases[f"{name}/cluster{k}/V"] for k in range(K)], dim=1)  # [d_in, K*R]
            Ut = torch.cat([bundle.bases[f"{name}/cluster{k}/U"] for k in range(K)], dim=1).T  # [K*R, d_out]
            diag = self.method == "jd-diag"
            cores = torch.zeros((M + 1, R) if diag else (M + 1, R, R), dtype=torch.float32)
            cluster = torch.zeros(M + 1, dtype=torch.int64)
            adapts = torch.zeros(M + 1, dtype=torch.bool)
            for member, c in mod["assignments"].items():
                i = self.index[member]
                cores[i] = bundle.cores[f"{name}/{member}"]
                cluster[i], adapts[i] = int(c), True
            self.modules[(layer, role)] = _Module(
                V=V.to(self.device, dtype).contiguous(), Ut=Ut.to(self.device, dtype).contiguous(),
                cores=cores.to(self.device, dtype), cluster=cluster.to(self.device), adapts=adapts.to(self.device),
                K=K, R=R)
        self.targeted = frozenset((layer, ROLE_SLICE[role][0]) for layer, role in self.modules)
        # residency is keyed by semantic_sha256 (the engine's view); members pinned from this bundle
        self._resident = {p.semantic_sha256: self.index[p.bundle_member] for p in (pinned or {}).values()
                          if p.ok and p.artifact_sha256 == self.bundle_sha256 and p.bundle_member in self.index}

    @staticmethod
    def bytes_needed(bundle, dtype: torch.dtype) -> int:
        """Device bytes the resident bundle takes (bases, cores with one zero row, tables)."""
        elem = torch.empty((), dtype=dtype).element_size()
        M = len(bundle.member_ids())
        R = int(bundle.manifest["options"]["rank"])
        core = R if bundle.method == "jd-diag" else R * R
        total = 0
        for mod in bundle.manifest["modules"].values():
            total += int(mod["clusters"]) * R * (int(mod["d_in"]) + int(mod["d_out"])) * elem
            total += (M + 1) * (core * elem + 9)
        return total

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for m in self.modules.values()
                   for t in (m.V, m.Ut, m.cores, m.cluster, m.adapts))

    @property
    def resident(self) -> dict[str, int]:
        """semantic_sha256 -> slot of every member pinned for the job (all resident, always)."""
        return dict(self._resident)

    def ensure(self, adapter_ids: list[str], pinned: dict[str, PinnedAdapter]) -> dict[str, int]:
        """adapter id -> slot (its member index); every member is already resident. An id
        that is not a servable member of this bundle raises BankError (never served as the
        base model or another member)."""
        out = {}
        for adapter_id in adapter_ids:
            p = pinned.get(adapter_id)
            if p is None:
                raise BankError("E_ADAPTER_UNKNOWN", f"adapter {adapter_id!r} was not pinned at job start")
            if not p.ok:
                raise BankError(p.error_code or "E_ADAPTER_INVALID", f"adapter {adapter_id!r} is not servable: "
                                f"{p.error_message}")
            if p.artifact_sha256 != self.bundle_sha256 or p.bundle_member not in self.index:
                raise BankError("E_BANK_BUNDLE_MISMATCH", f"adapter {adapter_id!r} is not a member of the bundle "
                                f"{self.bundle_sha256[:16]} this job serves with the three-stage operator; serve "
                                "mixed jobs with --bundle-operator materialized")
            out[adapter_id] = self.index[p.bundle_member]
            self.stats.hits += 1
        return out

    def close(self) -> None:
        """Nothing runs in the background (no loads, no prefetch threads)."""

    def context(self, row_slots: torch.Tensor, static=None) -> "BundleContext":
        """The LoraContext of one invocation. ``row_slots`` [T]: each packed row's member
        index, -1 for the base model. ``static``: a [T] int64 device buffer (a captured
        graph's) to copy the row members into; the context then reads that buffer."""
        if row_slots.dim() != 1:
            raise ValueError(f"row_slots must be 1-D, got shape {tuple(row_slots.shape)}")
        host = row_slots.to("cpu", torch.int64)
        if host.numel() and (int(host.min()) < -1 or int(host.max()) >= self.num_slots):
            raise BankError("E_BANK_SLOT_EMPTY", f"row_slots must lie in [-1, {self.num_slots}); -1 = base only")
        members = torch.where(host < 0, self.num_slots, host)  # the zero core's row
        if static is not None:
            static[: members.numel()].copy_(members, non_blocking=True)
            return BundleContext(self, static[: members.numel()])
        return BundleContext(self, members.to(self.device, non_blocking=True))

    def graph_context(self, row_members: torch.Tensor) -> "BundleContext":
        """A context over a static row-member buffer (capture once, refill with ``context(...,
        static=row_members)`` before each replay); padded rows hold the zero core's index."""
        row_members.fill_(self.num_slots)
        return BundleContext(self, row_members)


class BundleContext:
    """``mlora.batch.lora.LoraContext`` of a BundleBank for one invocation."""

    def __init__(self, bank: BundleBank, row_members: torch.Tensor):
        self.bank, self.row_members = bank, row_members

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the members' three-stage deltas to ``y`` in place (semantics: module docstring)."""
        bank = self.bank
        if (layer, group) not in bank.targeted:
            return
        T = x.shape[0]
        rows = torch.arange(T, device=x.device)
        m_idx = self.row_members
        for j, role in enumerate(GROUPS[group]):
            mod = bank.modules.get((layer, role))
            if mod is None:
                continue
            H = (x @ mod.V).view(T, mod.K, mod.R)  # every cluster's projection
            c = mod.cluster[m_idx]
            h = H[rows, c]  # [T, R]: the row's own cluster
            core = mod.cores[m_idx]
            h = h * core if core.dim() == 2 else torch.bmm(core, h.unsqueeze(-1)).squeeze(-1)
            onehot = torch.zeros(T, mod.K, mod.R, dtype=h.dtype, device=h.device)
            onehot[rows, c] = h
            delta = onehot.view(T, mod.K * mod.R) @ mod.Ut
            off, w = bank.offsets[group][j], bank.widths[group][j]
            out = y[:, off : off + w]
            out.copy_(torch.where(mod.adapts[m_idx][:, None], out + delta.to(out.dtype), out))
