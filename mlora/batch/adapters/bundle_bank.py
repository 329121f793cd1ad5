"""Serving a collection bundle with the three-stage operator (docs/design.md, Bundle and three-stage operator).

Owns the device copies of one bundle's shared bases and per-member cores and
the LoraContext that applies them. Must not read bundle files itself (the
bundle verified at pin time, ``mlora.batch.adapters.bundles``, hands its tensors over)
nor know the model's layer code (``mlora.batch.model.lora`` is the seam).

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

The modules of one (layer, group) that share their input (q/k/v, gate/up) are
applied together: one projection GEMM over every role's clusters
(``[V^q_0 .. V^q_K | V^k_0 .. | V^v_0 ..]``), one gather of the rows' cluster
columns, one core product, one scatter, one expansion GEMM per role and one
masked update of the group's output: about 13 kernels for q/k/v instead of
about 30 (a decode step replays one per group and layer). The slot tables'
module columns are in (layer, group, slice) order so a group's modules are one
contiguous column range.

Residency: the shared bases are loaded when the job starts and
stay resident for the whole job, so a basis is never evicted while a member is
in flight, and a core is only ever used with the basis generation it was
fitted with (both come from the one verified bundle, checked at pin time).
Members' cores live in ``core_slots`` device slots (all members' cores for
all modules of one member in one slot row). When every member has a slot
(the default when the bundle fits in the adapters' share of GPU memory) all
are loaded at start and slot = member index. With fewer slots
(``--max-gpu-adapters``, or the bundle larger than the share while its bases
fit), ``ensure`` copies a member's cores from host memory into a free slot or
the least recently used one the call does not name, on the current stream:
the kernels of earlier invocations that read the slot were enqueued before the
copy, so stream order retires them first. More distinct members in one call
than slots is E_BANK_FULL (the scheduler admits at most ``num_slots``). Not
built yet: eviction of bases (they must fit: ``E_BUNDLE_TOO_LARGE``).

Tensor parallelism (``BundleBank.for_rank``; docs/scaleout.md, "Tensor parallelism: how
adapters are placed"): the shared bases follow the base projection as a LoRA's A and B do
(``V_c`` as A, ``U_c`` as B, cut by ``mlora.batch.model.tp.shard_lora``), the cores are whole
on every rank. q/k/v and gate/up: ``V`` whole (each rank projects itself), ``U`` the rank's
output rows. o and down: ``V`` the rank's input columns, so ``h_t`` is a partial sum; the
gathered ``h_t`` (``n R`` columns, not the ``K R`` of ``H_t``: the gather only selects, so
summing after it is exact and K times smaller) is all-reduced before the core, and ``U``'s
rows ``[j h/N, (j+1) h/N)`` add into those columns of the rank's base partial.

Two operators, chosen per bank (``operator=``; the engine always takes the default):

* ``"torch"`` (default): the grouped dense GEMMs above, on either device.
* ``"triton"`` (opt-in with ``--bundle-operator three-stage-triton``; CUDA, or the CPU
  interpreter in tests): the segmented LoRA kernels with the slot still the
  member (``mlora.kernels.triton_sgmv.add_bundle_slices_triton``), one shrink and one
  expand launch per (layer, group) over one LaunchPlan per invocation built from the
  rows' slots (base rows are not in it). Per (layer, group) the bank holds the cluster
  bases as the kernels' A bank ``[K, n, R, d_in]`` (``V_c^T``) and B bank ``[K, sum(w),
  R]`` (``U_c``) of the n slices the bundle adapts there (K: their most clusters; a
  slice with fewer leaves zero rows, never read), and the kernels read per-(layer,
  group) views of the slot tables: ``slot_cluster`` as the slot -> bank-row map,
  ``slot_ranks`` (R where the member adapts the module, else 0: those columns stay
  bit-identical), ``slot_cores`` (applied to z in the expand). Captured graphs read a
  static LaunchPlan per row buffer and batch size, refilled by ``context(...,
  static=buf)``. Numerics: fp32 accumulation and core product; 16-bit bases run the
  dots on tensor cores (z rounded to the bases' dtype after the core), where the torch
  path rounds the projection to the model dtype before the core.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from mlora.batch.adapters.catalog import PinnedAdapter
from mlora.batch.adapters.protocol import BlockingLoads, GraphLora
from mlora.batch.adapters.slots import BankError, BankStats, TPShard, lru_slot
from mlora.batch.model.lora import GROUPS, ROLE_SLICE, config_role_shapes, module_layer_role
from mlora.batch.model.tp import bank_shapes, lora_cuts, shard_lora
from mlora.kernels import LaunchPlan, build_plan, empty_launch_plan, make_launch_plan, tile_capacity
from mlora.kernels.launch import DECODE_BLOCK_M
from mlora.kernels.triton_sgmv import _INTERPRET, add_bundle_slices_triton

# "torch": grouped dense GEMMs over all clusters (BundleContext), the default; "triton": the segmented kernels with the member as the
# slot, one LaunchPlan per invocation (BundleTritonContext, docs/compress.md)
OPERATORS = ("torch", "triton")


@dataclass
class _Group:
    """The bank's modules of one (layer, group), in slice order: ``roles`` (slice index j,
    its ``_Module``), ``V`` [d_in, sum_j K_j*R] every role's clusters side by side,
    ``voff`` each role's first column in it, ``lo:hi`` the roles' columns in the slot
    tables, ``col_module`` int64 [group width]: each output column's table column (``M``,
    the tables' always-False extra column, where the bank holds no module). On a
    tensor-parallel rank's o or down: ``reduce`` (the gathered projections are partial sums)
    and ``out_start``, the first column of the base partial the group's columns add at."""

    roles: list
    V: torch.Tensor
    voff: list[int]
    lo: int
    hi: int
    col_module: torch.Tensor
    reduce: bool = False
    out_start: int = 0


@dataclass
class _Module:
    """Device tensors of one (layer, role): ``V`` [d_in, K*R], ``Ut`` [K*R, d_out], and
    views of the bank's slot tables: ``cores`` [S+1, R, R] (JD-Full) or [S+1, R] (JD-Diag)
    with row S all zero, ``cluster`` int32 [S+1] (slot -> its member's cluster, 0 for S),
    ``adapts`` bool [S+1] (False for S and for members that do not adapt the module)."""

    V: torch.Tensor
    Ut: torch.Tensor
    cores: torch.Tensor
    cluster: torch.Tensor
    adapts: torch.Tensor
    K: int
    R: int
    index: int  # its column in the bank's slot tables


@dataclass
class _Banks:
    """The Triton operator's tensors of one (layer, group) (``add_bundle_slices_triton``'s
    arguments): ``A`` [K, n, R, d_in] with ``A[c, k] = V_c^T`` and ``B`` [K, sum(widths), R]
    with ``B[c, off_k : off_k + w_k] = U_c`` of the k-th slice the bundle adapts here (K: the
    most clusters of any of them; rows past a slice's own clusters are zero and never read),
    ``widths`` and ``out_offsets`` (first y column) of those slices, and views of the slot
    tables: ``ranks`` int32 [n, S+1] (R where the slot's member adapts the slice, else 0),
    ``rows`` int32 [n, S+1] (its cluster: the bank row), ``cores`` [S+1, n, R(, R)]. On a
    tensor-parallel rank's o or down, ``reduce``: the projections are partial sums, summed
    over the ranks between the kernels' two launches."""

    A: torch.Tensor
    B: torch.Tensor
    widths: list[int]
    out_offsets: list[int]
    ranks: torch.Tensor
    rows: torch.Tensor
    cores: torch.Tensor
    diag: bool
    reduce: bool = False


def _columns(indices: list[int]) -> tuple[int, int]:
    """``(lo, hi)``: the slot-table columns of one (layer, group)'s modules, which are
    contiguous because the columns are in (layer, group, slice) order."""
    assert indices == list(range(indices[0], indices[0] + len(indices))), \
        "table columns not in (layer, group, slice) order"
    return indices[0], indices[-1] + 1


class BundleBank(BlockingLoads):
    """One bundle's shared bases resident and its members' cores in ``num_slots`` slots
    (``core_slots``; default one per member, loaded at start, slot = member index).
    An ``AdapterBank`` (``mlora.batch.adapters.protocol``) whose loads happen inside ``ensure``.
    With ``tp`` (:meth:`for_rank`) it holds one tensor-parallel rank's cut of the bases."""

    error = BankError

    def __init__(self, bundle, num_layers: int, shapes: dict[str, tuple[int, tuple[int, ...]]], dtype: torch.dtype,
                 device, pinned: dict[str, PinnedAdapter] | None = None, core_slots: int | None = None,
                 operator: str = "torch", tp: TPShard | None = None):
        if operator not in OPERATORS:
            raise ValueError(f"unknown bundle operator {operator!r}; expected one of {OPERATORS}")
        self.tp = tp if tp is not None and tp.layout.size > 1 else None
        # row-parallel group -> the first column of the rank's base partial its columns add at
        self.out_start = bank_shapes(tp.config, tp.layout)[1] if self.tp is not None else {}
        self.operator = operator
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_layers = num_layers
        self.bundle_sha256 = bundle.manifest["bundle_sha256"]
        self.method = bundle.method
        self.members = bundle.member_ids()
        self.index = {m: i for i, m in enumerate(self.members)}
        M = len(self.members)
        self.num_slots = S = M if core_slots is None else max(1, min(M, int(core_slots)))
        self.max_rank = int(bundle.manifest["options"]["rank"])
        self.groups = tuple(g for g in GROUPS if g in shapes)
        self.widths = {g: tuple(int(w) for w in shapes[g][1]) for g in self.groups}
        self.offsets = {g: [sum(self.widths[g][:j]) for j in range(len(self.widths[g]))] for g in self.groups}
        self.stats = BankStats()
        R, diag = self.max_rank, self.method == "jd-diag"
        group_order = {g: k for k, g in enumerate(GROUPS)}

        def table_order(name: str):  # (layer, group, slice): a group's modules are adjacent columns
            layer, role = module_layer_role(name)
            g, j = ROLE_SLICE.get(role, ("", -1))
            return (-1 if layer is None else layer, group_order.get(g, -1), j, name)

        names = sorted(bundle.manifest["modules"], key=table_order)
        core_shape = (R,) if diag else (R, R)
        # host tables, member-major: one member's cores for every module are one contiguous row
        host_cores = torch.zeros((M, len(names)) + core_shape, dtype=torch.float32)
        host_cluster = torch.zeros(M, len(names), dtype=torch.int32)
        host_ranks = torch.zeros(M, len(names), dtype=torch.int32)
        host_adapts = torch.zeros(M, len(names), dtype=torch.bool)
        bases = {}
        whole = config_role_shapes(self.tp.config) if self.tp is not None else None  # role -> (d_out, d_in)
        for mi, name in enumerate(names):
            mod = bundle.manifest["modules"][name]
            layer, role = module_layer_role(name)
            group, j = ROLE_SLICE.get(role, ("", -1))
            if group not in self.widths or layer is None or not 0 <= layer < num_layers:
                raise BankError("E_BANK_SHAPE", f"bundle module {name} does not fit the model")
            d_out, d_in = whole[role] if whole is not None else (self.widths[group][j], int(shapes[group][0]))
            if (int(mod["d_out"]), int(mod["d_in"])) != (d_out, d_in):
                raise BankError("E_BANK_SHAPE", f"bundle module {name} is [{mod['d_out']}, {mod['d_in']}], the model "
                                f"has [{d_out}, {d_in}]")
            K = int(mod["clusters"])
            V = torch.cat([bundle.bases[f"{name}/cluster{k}/V"] for k in range(K)], dim=1)  # [d_in, K*R]
            Ut = torch.cat([bundle.bases[f"{name}/cluster{k}/U"] for k in range(K)], dim=1).T  # [K*R, d_out]
            if self.tp is not None:  # V^T as a LoRA's A [K*R, d_in], U as its B [d_out, K*R]: the rank's cut
                a, b = shard_lora(role, V.T, Ut.T, self.tp.config, self.tp.layout)
                V, Ut = a.T, b.T
            for member, c in mod["assignments"].items():
                i = self.index[member]
                host_cores[i, mi] = bundle.cores[f"{name}/{member}"]
                host_cluster[i, mi], host_ranks[i, mi], host_adapts[i, mi] = int(c), R, True
            bases[(layer, role)] = (mi, V, Ut, K)
        # device slot tables; row S is the base model's (zero core, adapts nothing)
        self.slot_cores = torch.zeros((S + 1, len(names)) + core_shape, dtype=dtype, device=self.device)
        self.slot_cluster = torch.zeros(S + 1, len(names), dtype=torch.int32, device=self.device)
        self.slot_ranks = torch.zeros(S + 1, len(names), dtype=torch.int32, device=self.device)
        self.slot_adapts = torch.zeros(S + 1, len(names), dtype=torch.bool, device=self.device)
        self.targeted = frozenset((layer, ROLE_SLICE[role][0]) for layer, role in bases)
        if operator == "torch":
            self._torch_groups(bases, len(names))
        else:
            self._triton_banks(bases, shapes)
        tables = (self.slot_cores, self.slot_cluster, self.slot_ranks, self.slot_adapts)
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # member -> slot, least recently used first
        if S == M:  # every member has its slot, for the whole job
            for table, host in zip(tables, (host_cores, host_cluster, host_ranks, host_adapts)):
                table[:M] = host.to(self.device, table.dtype)
            self._slot_of.update((i, i) for i in range(M))
            self._host = None
        else:  # cores stay on the host (page-locked on a GPU: copies are asynchronous) until a slot takes them
            hosts = (host_cores.to(dtype), host_cluster, host_ranks, host_adapts)
            self._host = tuple(t.pin_memory() for t in hosts) if self.device.type == "cuda" else hosts
        self._tables = tables
        # (buffer address, rows) -> (buffer, its static LaunchPlan)
        self._static_plans: dict[tuple[int, int], tuple[torch.Tensor, LaunchPlan]] = {}
        # residency is keyed by semantic_sha256 (the engine's view); members pinned from this bundle
        self._sha_of = {self.index[p.bundle_member]: p.semantic_sha256 for p in (pinned or {}).values()
                        if p.ok and p.artifact_sha256 == self.bundle_sha256 and p.bundle_member in self.index}

    def _torch_groups(self, bases: dict, num_columns: int) -> None:
        """The torch operator's device tensors: per module its ``V`` and ``Ut``, per (layer,
        group) the joint projection matrix and the column maps (``_Group``, ``col_base``)."""
        R, dtype = self.max_rank, self.dtype
        bases = {key: (mi, V.to(self.device, dtype).contiguous(), Ut.to(self.device, dtype).contiguous(), K)
                 for key, (mi, V, Ut, K) in bases.items()}
        self.modules: dict[tuple[int, str], _Module] = {
            key: _Module(V=V, Ut=Ut, cores=self.slot_cores[:, mi], cluster=self.slot_cluster[:, mi],
                         adapts=self.slot_adapts[:, mi], K=K, R=R, index=mi)
            for key, (mi, V, Ut, K) in bases.items()}
        self.groups_of: dict[tuple[int, str], _Group] = {}
        for layer, group in sorted(self.targeted):
            roles = [(j, self.modules[(layer, role)]) for j, role in enumerate(GROUPS[group])
                     if (layer, role) in self.modules]
            voff = [sum(m.K * m.R for _, m in roles[:k]) for k in range(len(roles))]
            col_module = torch.full((sum(self.widths[group]),), num_columns, dtype=torch.int64)
            for j, m in roles:
                off = self.offsets[group][j]
                col_module[off : off + self.widths[group][j]] = m.index
            lo, hi = _columns([m.index for _, m in roles])
            grp = self.groups_of[(layer, group)] = _Group(
                roles, torch.cat([m.V for _, m in roles], dim=1).contiguous(), voff, lo, hi, col_module.to(self.device),
                reduce=group in self.out_start, out_start=self.out_start.get(group, 0))
            for (_, m), v in zip(roles, voff):
                m.V = grp.V[:, v : v + m.K * m.R]  # a view: the bases are held once
        # each table column's first column in its group's projection, plus 0 .. R-1: the
        # projection columns of cluster c are col_base + c * R
        col_base = torch.zeros(num_columns, R, dtype=torch.int64)
        for grp in self.groups_of.values():
            for (_, m), v in zip(grp.roles, grp.voff):
                col_base[m.index] = v + torch.arange(R)
        self.col_base = col_base.to(self.device)

    def _triton_banks(self, bases: dict, shapes: dict) -> None:
        """The Triton operator's device tensors: per (layer, group) its cluster bases as the
        segmented kernels' A and B banks and views of the slot tables (``_Banks``)."""
        if self.device.type != "cuda" and not _INTERPRET:
            raise ValueError("the triton bundle operator needs a CUDA device (or TRITON_INTERPRET=1)")
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"the triton bundle operator serves bfloat16, float16 or float32, not {self.dtype}")
        R = self.max_rank
        self.banks: dict[tuple[int, str], _Banks] = {}
        for layer, group in sorted(self.targeted):
            held = [(j, bases[(layer, role)]) for j, role in enumerate(GROUPS[group]) if (layer, role) in bases]
            widths = [self.widths[group][j] for j, _ in held]
            K, d_in = max(b[3] for _, b in held), int(shapes[group][0])
            A = torch.zeros(K, len(held), R, d_in, dtype=self.dtype)
            B = torch.zeros(K, sum(widths), R, dtype=self.dtype)
            for k, (_, (_, V, Ut, Kj)) in enumerate(held):
                off = sum(widths[:k])
                A[:Kj, k] = V.T.reshape(Kj, R, d_in)  # V_c^T
                B[:Kj, off : off + widths[k]] = Ut.reshape(Kj, R, -1).transpose(1, 2)  # U_c
            lo, hi = _columns([b[0] for _, b in held])
            start = self.out_start.get(group, 0)  # a row-parallel rank's columns of its base partial
            self.banks[(layer, group)] = _Banks(
                A.to(self.device), B.to(self.device), widths,
                [start + self.offsets[group][j] for j, _ in held], self.slot_ranks[:, lo:hi].t(),
                self.slot_cluster[:, lo:hi].t(), self.slot_cores[:, lo:hi], self.method == "jd-diag",
                group in self.out_start)

    @classmethod
    def for_rank(cls, bundle, tp: TPShard, dtype: torch.dtype, device, pinned: dict[str, PinnedAdapter] | None = None,
                 core_slots: int | None = None, operator: str = "torch") -> BundleBank:
        """The bank of one tensor-parallel rank: its cut of every basis (module docstring), at
        the shapes of the rank's part of the model (``tp.bank_shapes``), every core whole."""
        return cls(bundle, tp.config.num_layers, bank_shapes(tp.config, tp.layout)[0], dtype, device, pinned,
                   core_slots, operator, tp)

    @staticmethod
    def bytes_needed(bundle, dtype: torch.dtype, operator: str = "torch") -> int:
        """Device bytes of the bank with one core slot per member (and the base model's zero row)."""
        bases, per_slot = BundleBank.split_bytes(bundle, dtype, operator)
        return bases + (len(bundle.member_ids()) + 1) * per_slot

    @staticmethod
    def split_bytes(bundle, dtype: torch.dtype, operator: str = "torch", tp: TPShard | None = None
                    ) -> tuple[int, int]:
        """(device bytes of the shared bases, device bytes of one core slot: every module's
        core, cluster, rank and adapts entries) for ``operator``. The torch operator holds
        each module's K clusters (with ``tp``: the rank's cut of them); the Triton operator's
        banks hold, per (layer, group), the group's most clusters for every slice it adapts
        (``[K_max, n, R, d_in]`` and ``[K_max, sum(widths), R]``), more where the slices'
        cluster counts differ."""
        if operator not in OPERATORS:
            raise ValueError(f"unknown bundle operator {operator!r}; expected one of {OPERATORS}")
        elem = torch.empty((), dtype=dtype).element_size()
        R = int(bundle.manifest["options"]["rank"])
        core = R if bundle.method == "jd-diag" else R * R
        modules = bundle.manifest["modules"]
        per_slot = len(modules) * (core * elem + 9)
        if operator == "torch":
            cuts = lora_cuts(tp.config, tp.layout) if tp is not None else {}

            def held(name: str, m: dict) -> int:  # d_in + d_out of the bases the rank holds
                cut = cuts.get(module_layer_role(name)[1])
                if cut is None:
                    return int(m["d_in"]) + int(m["d_out"])
                return (int(m["d_in"]) if cut.a is None else cut.a.length) + cut.b.length

            bases = sum(int(m["clusters"]) * R * held(name, m) * elem for name, m in modules.items())
            return bases, per_slot
        groups: dict[tuple, list] = {}  # (layer, group) -> its modules
        for name, m in modules.items():
            layer, role = module_layer_role(name)
            groups.setdefault((layer, ROLE_SLICE[role][0]), []).append(m)
        bases = sum(max(int(m["clusters"]) for m in ms) * R * sum(int(m["d_in"]) + int(m["d_out"]) for m in ms)
                    for ms in groups.values()) * elem
        return bases, per_slot

    def nbytes(self) -> int:
        """Device bytes held: the slot tables and every basis (a group's joint projection
        matrix is stored instead of its modules' separate V)."""
        tables = sum(t.numel() * t.element_size() for t in self._tables)
        if self.operator == "triton":
            return tables + sum(t.numel() * t.element_size() for b in self.banks.values() for t in (b.A, b.B))
        return tables + sum(g.V.numel() * g.V.element_size() for g in self.groups_of.values()) + sum(
            m.Ut.numel() * m.Ut.element_size() for m in self.modules.values())

    @property
    def resident(self) -> dict[str, int]:
        """semantic_sha256 -> slot of every pinned member whose cores are in a slot, least
        recently used first."""
        return {self._sha_of[i]: slot for i, slot in self._slot_of.items() if i in self._sha_of}

    def source_tier(self, adapter_id: str, pinned: dict[str, PinnedAdapter]) -> str:
        """Where a member's load copies from: its cores are held in host memory."""
        return "host"

    def ensure(self, adapter_ids: list[str], pinned: dict[str, PinnedAdapter]) -> dict[str, int]:
        """adapter id -> slot of every listed member, loading the cores of members without a
        slot (LRU eviction among members this call does not name). An id that is not a
        servable member of this bundle raises BankError (never served as the base model or
        another member); more distinct members than slots raise E_BANK_FULL."""
        member_of, pin_of = {}, {}
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
            member_of[adapter_id] = self.index[p.bundle_member]
            pin_of.setdefault(member_of[adapter_id], p)
        wanted = dict.fromkeys(member_of.values())
        if len(wanted) > self.num_slots:
            raise BankError("E_BANK_FULL", f"{len(wanted)} distinct bundle members requested at once, the bank has "
                            f"{self.num_slots} core slots; the scheduler must admit at most that many")
        for i in wanted:
            if i in self._slot_of:
                self.stats.hits += 1
                self._slot_of.move_to_end(i)
            else:
                self.stats.misses += 1
                self._load(i, pin_of[i], wanted)
                self.stats.loads += 1
        return {a: self._slot_of[i] for a, i in member_of.items()}

    def _load(self, member: int, p: PinnedAdapter, keep) -> None:
        """Copy ``member``'s cores (``p``: a pin naming it) into a free slot, else into the least
        recently used slot of a member not in ``keep``."""
        self._write(lru_slot(self._slot_of, self.num_slots, keep, self.stats), member)

    def load_into(self, slot: int, p: PinnedAdapter) -> None:
        """Copy the cores of ``p``'s member into ``slot``, whatever it held (a tensor-parallel
        follower: rank 0's bank chose the slot)."""
        if p.artifact_sha256 != self.bundle_sha256 or p.bundle_member not in self.index:
            raise BankError("E_BANK_BUNDLE_MISMATCH", f"adapter {p.id!r} is not a member of the bundle "
                            f"{self.bundle_sha256[:16]} this bank serves")
        for member in [i for i, s in self._slot_of.items() if s == slot]:
            del self._slot_of[member]
        self._write(slot, self.index[p.bundle_member])

    def _write(self, slot: int, member: int) -> None:
        for table, host in zip(self._tables, self._host):
            table[slot].copy_(host[member], non_blocking=True)
        self._slot_of[member] = slot

    def close(self) -> None:
        """Nothing runs in the background (no loads, no prefetch threads)."""

    def context(self, row_slots: torch.Tensor, static=None) -> "BundleContext":
        """The LoraContext of one invocation. ``row_slots`` [T]: each packed row's slot (from
        :meth:`ensure`), -1 for the base model; a slot that holds no member is refused (it
        would serve the base model silently). ``static``: a [T] int64 device buffer (a
        captured graph's) to copy the row slots into; the context then reads that buffer."""
        if row_slots.dim() != 1:
            raise ValueError(f"row_slots must be 1-D, got shape {tuple(row_slots.shape)}")
        host = row_slots.to("cpu", torch.int64)
        if host.numel() and (int(host.min()) < -1 or int(host.max()) >= self.num_slots):
            raise BankError("E_BANK_SLOT_EMPTY", f"row_slots must lie in [-1, {self.num_slots}); -1 = base only")
        if len(self._slot_of) < self.num_slots:
            empty = set(host.tolist()) - {-1} - set(self._slot_of.values())
            if empty:
                raise BankError("E_BANK_SLOT_EMPTY", f"slots {sorted(empty)} hold no member (ensure loads them)")
        if self.operator == "triton":
            return BundleTritonContext(self, self._launch_plan(host, static))
        members = torch.where(host < 0, self.num_slots, host)  # the zero core's row
        if static is not None:
            static[: members.numel()].copy_(members, non_blocking=True)
            return BundleContext(self, static[: members.numel()])
        return BundleContext(self, members.to(self.device, non_blocking=True))

    def graph_context(self, row_members: torch.Tensor) -> "BundleContext":
        """A context over a static row-member buffer (capture once, refill with ``context(...,
        static=row_members)`` before each replay); padded rows hold the zero core's index."""
        row_members.fill_(self.num_slots)
        if self.operator == "triton":
            return BundleTritonContext(self, self._static_plan(row_members, row_members.numel()))
        return BundleContext(self, row_members)

    def graph_lora(self, rows: int) -> GraphLora:
        """The LoRA context a decode graph of ``rows`` rows is captured with: a
        :meth:`graph_context` over a static row buffer of its own, which ``context(row_slots,
        static=buffer)`` refills before each replay."""
        members = torch.zeros(rows, dtype=torch.int64, device=self.device)
        return GraphLora(self.graph_context(members), members)

    def _launch_plan(self, host: torch.Tensor, static) -> LaunchPlan | None:
        """The Triton operator's tile list of one invocation from the host row slots (-1:
        base model, not in the plan), built on the host (nothing waits for the device): in
        the static plan of ``static`` (a graph's row buffer, :meth:`_static_plan`), refilled
        only when the row slots differ from its last fill (``LaunchPlan.fill_from_rows``: a
        slot's member may change between calls, but the plan maps rows to slots, not to
        members), else moved to the device; None when no row has a member."""
        if static is not None:
            lp = self._static_plan(static, host.numel())
            lp.fill_from_rows(host)
            return lp
        plan = build_plan(host)
        return make_launch_plan(plan).to(self.device) if plan.num_segments else None

    def _static_plan(self, static: torch.Tensor, rows: int) -> LaunchPlan:
        """The static LaunchPlan buffers a captured graph of ``rows`` rows reads, keyed by its
        row buffer (``graph_context(buf[:rows])`` and ``context(..., static=buf)`` of ``rows``
        row slots name the same plan), held with the buffer, so the key's address is never
        reused. Empty (no tiles) until ``context`` fills it."""
        key = (static.data_ptr(), rows)
        if key not in self._static_plans:
            lp = empty_launch_plan(rows, tile_capacity(rows, self.num_slots, DECODE_BLOCK_M), DECODE_BLOCK_M,
                                   self.device)
            self._static_plans[key] = (static, lp)
        return self._static_plans[key][1]


class BundleContext:
    """``mlora.batch.model.lora.LoraContext`` of a BundleBank for one invocation. The rows' tables
    (every module's projection columns of the row's cluster, and whether the row's member
    adapts it) are gathered once per forward pass, at its first ``apply``, not once per
    module. A context can serve several passes (a graph's warm-up run, then its capture):
    a pass starts when a (layer, group) is applied again, and then gathers anew, so a
    captured pass records its own gathers and a replay redoes them for its rows (reusing
    the warm-up's tensors would replay stale rows)."""

    def __init__(self, bank: BundleBank, row_members: torch.Tensor):
        self.bank, self.row_members = bank, row_members
        self._rows = None  # (projection columns [T, modules, R], adapts [T, modules + 1]) of this pass
        self._applied: set = set()  # the (layer, group) pairs applied in this pass

    def _row_tables(self, key, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rows is None or key in self._applied or self._rows[0].shape[0] != T:
            bank, m_idx = self.bank, self.row_members
            cols = bank.col_base + bank.slot_cluster[m_idx].unsqueeze(-1) * bank.max_rank
            adapts = torch.cat([bank.slot_adapts[m_idx], torch.zeros(T, 1, dtype=torch.bool, device=m_idx.device)], 1)
            self._rows = (cols, adapts)
            self._applied = set()
        self._applied.add(key)
        return self._rows

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the members' three-stage deltas to ``y`` in place (semantics: module docstring)."""
        bank = self.bank
        grp = bank.groups_of.get((layer, group))
        if grp is None:
            return
        T, R, n = x.shape[0], bank.max_rank, grp.hi - grp.lo
        cols, adapts = self._row_tables((layer, group), T)
        H = x @ grp.V  # [T, sum_j K_j R]: every role's every cluster
        h = H.gather(1, cols[:, grp.lo : grp.hi].reshape(T, n * R))  # [T, n R]: each role's row cluster
        if grp.reduce:  # o or down on a tensor-parallel rank: h of its input columns, summed over the ranks
            bank.tp.collective.all_reduce(h)  # on every rank alike: the same rows and (layer, group)s
            y = y[:, grp.out_start : grp.out_start + grp.col_module.numel()]  # the rank's columns of its partial
        core = bank.slot_cores[:, grp.lo : grp.hi][self.row_members]  # [T, n, R] or [T, n, R, R]
        if core.dim() == 3:  # JD-Diag
            h = h * core.reshape(T, n * R)
        else:
            h = torch.matmul(core, h.view(T, n, R, 1)).view(T, n * R)
        onehot = torch.zeros_like(H).scatter_(1, cols[:, grp.lo : grp.hi].reshape(T, n * R), h)
        parts, at = [], 0
        for (j, mod), v in zip(grp.roles, grp.voff):
            off = bank.offsets[group][j]
            if off > at:  # a slice the bank holds no module for: no delta
                parts.append(y.new_zeros(T, off - at))
            parts.append((onehot[:, v : v + mod.K * R] @ mod.Ut).to(y.dtype))
            at = off + bank.widths[group][j]
        if y.shape[1] > at:
            parts.append(y.new_zeros(T, y.shape[1] - at))
        delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        torch.where(adapts[:, grp.col_module], y + delta, y, out=y)


class BundleTritonContext:
    """``mlora.batch.model.lora.LoraContext`` of a BundleBank with ``operator="triton"`` for one
    invocation: one LaunchPlan over the rows' members (the slot is the member), shared by
    every (layer, group); None when every row is the base model's."""

    def __init__(self, bank: BundleBank, plan: LaunchPlan | None):
        self.bank, self.plan = bank, plan

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the members' three-stage deltas to ``y`` in place: one shrink and one expand
        launch (``add_bundle_slices_triton``; semantics: module docstring). Base rows and
        slices a row's member does not adapt (rank 0) stay bit-identical."""
        banks = self.bank.banks.get((layer, group))
        if banks is None or self.plan is None:
            return
        reduce_z = self.bank.tp.collective.all_reduce if banks.reduce else None
        add_bundle_slices_triton(y, x, banks.A, banks.B, self.plan, banks.ranks, banks.rows, banks.cores,
                                 banks.widths, banks.out_offsets, diag=banks.diag, reduce_z=reduce_z)
