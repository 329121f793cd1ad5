"""Load a collection of PEFT adapters as factored per-module updates (the solvers' input).

Owns the step from adapter directories to ``{module: {member: FactoredDelta}}``
for ``mlora compress`` (conversion is offline and fails closed).
Every member is validated as ``mlora validate`` does (``mlora.lora_tools``), against
the base when one is given; any member that is invalid or not servable, an
activated LoRA (aLoRA: a bundle core carries no activation rule), a duplicate
member id, or members bound to different bases stop the load with a named
error (no partial collection). Factors are read again when their
module is fitted (one module at a time) and must hash to the scanned digests
(``E_COMPRESS_MEMBER_CHANGED`` otherwise), so what is compressed is exactly
what was validated.

``Delta = scale * B @ A`` with PEFT's ``lora_A`` as A [r, d_in], ``lora_B`` as
B [d_out, r] and the semantic scale of the member's config (alpha / r,
rsLoRA, rank and alpha patterns resolved by ``mlora.lora_tools``). A member that does not
target a module is simply absent from that module's collection.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from mlora.compress.solvers import CompressError, FactoredDelta
from mlora.lora_tools.adapter import check_against_base, discover_adapters, open_adapter, scan_adapters
from mlora.lora_tools.manifest import base_identity, build_manifest, load_base
from mlora.lora_tools.safetensors_io import TensorChanged, read_verified

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class Member:
    id: str
    path: str
    artifact_sha256: str
    semantic_sha256: str


@dataclass
class Collection:
    """Validated members and, per module, where each member's factors lie. Factors are
    read (and re-hashed) only when a module is asked for: ``modules[module]`` or
    :meth:`factors`, so a whole-collection fit holds one module's factors at a time
    (memory O(n r d) per module), not the collection's."""

    base_sha256: str
    members: list[Member]
    refs: dict[str, dict[str, tuple]] = field(default_factory=dict)  # module -> member id -> (a, a_sha, b, b_sha, scale)
    dtype: torch.dtype = torch.float64

    @property
    def modules(self) -> "Mapping[str, dict[str, FactoredDelta]]":
        """module -> member id -> delta, read on access (not cached)."""
        return _Modules(self)

    def read(self, module: str) -> dict[str, FactoredDelta]:
        return {member: FactoredDelta(_read(a, a_sha, member, self.dtype), _read(b, b_sha, member, self.dtype), scale)
                for member, (a, a_sha, b, b_sha, scale) in self.refs.get(module, {}).items()}

    def factors(self, module: str) -> tuple[list[str], list[FactoredDelta]]:
        """Member ids and their deltas at ``module``, in member order."""
        per = self.read(module)
        ids = [m.id for m in self.members if m.id in per]
        return ids, [per[i] for i in ids]


class _Modules(Mapping):
    def __init__(self, col: Collection):
        self.col = col

    def __getitem__(self, module: str) -> dict[str, FactoredDelta]:
        if module not in self.col.refs:
            raise KeyError(module)
        return self.col.read(module)

    def __iter__(self):
        return iter(self.col.refs)

    def __len__(self) -> int:
        return len(self.col.refs)


def load_collection(paths: list[str], base_dir: str | None = None, *, dtype: torch.dtype = torch.float64,
                    workers: int | None = None) -> Collection:
    """Validate and read every adapter named by ``paths`` (adapter directories or
    directories of them); raises CompressError naming the first problem."""
    dirs: list[str] = []
    for p in paths:
        found = discover_adapters(p)
        if not found:
            raise CompressError("E_COMPRESS_MEMBER_INVALID", f"{p} holds no adapter (no adapter_config.json)")
        dirs += found
    arts = [open_adapter(d) for d in dirs]
    ids = [a.name for a in arts]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise CompressError("E_COMPRESS_DUPLICATE_ID", f"member ids must be unique (directory names): {dup}")
    scan_adapters(arts, workers)
    base_id = None
    if base_dir is not None:
        base = load_base(base_dir)
        for a in arts:
            check_against_base(a, base)
        base_id = base_identity(base, workers)
    members, bases = [], set()
    for art in arts:
        man = build_manifest(art, base_id)
        if not (man["valid"] and man["servable"]):
            bad = next((f for f in art.findings if f.severity in ("error", "unservable")), None)
            what = f"{bad.code}: {bad.message}" if bad else "not valid"
            raise CompressError("E_COMPRESS_MEMBER_INVALID", f"member {art.name!r} cannot be compressed ({what}); "
                                "fix or drop it (mlora validate shows every finding)")
        if man["activation_policy"]["kind"] == "alora":
            raise CompressError("E_COMPRESS_ALORA", f"member {art.name!r} is an activated LoRA (alora_invocation_tokens "
                                f"{man['activation_policy']['invocation_tokens']}): a bundle core carries no "
                                "activation rule; drop it from the collection and serve it as a plain adapter "
                                "directory with `mlora batch-run`")
        bases.add(man["base"]["base_sha256"])
        members.append(Member(art.name, art.path, man["artifact_sha256"], man["semantic_sha256"]))
    if len(bases) > 1:
        raise CompressError("E_COMPRESS_BASE_MISMATCH", "members are bound to different bases; a collection "
                            "shares one base (pass --base to bind them all to the measured base)")
    col = Collection(next(iter(bases)) if bases else "", members, dtype=dtype)
    for art in arts:
        for rec in art.modules:
            col.refs.setdefault(rec.name, {})[art.name] = (rec.a, rec.a_sha256, rec.b, rec.b_sha256, float(rec.scale))
    return col


def _read(t, digest: str | None, member: str, dtype: torch.dtype) -> torch.Tensor:
    """A factor's bytes, re-hashed against the scanned digest, as a ``dtype`` tensor."""
    try:
        data = read_verified(t, digest)
    except TensorChanged:
        raise CompressError("E_COMPRESS_MEMBER_CHANGED", f"member {member!r}: {t.name} changed since it was "
                            "validated; rerun the command on stable files") from None
    return torch.frombuffer(data, dtype=_DTYPES[t.dtype]).reshape(t.shape).to(dtype)
