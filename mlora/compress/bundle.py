"""Collection bundles: fit a whole collection, write it immutably, read it back verified, export members.

Owns the bundle format (docs/compress.md, The bundle: a core is meaningless
without its collection identity) and the pipeline of ``mlora compress`` around
the solvers: one fit per module (JD-Full or JD-Diag, optionally clustered), the
``--max-error`` gate, the parameter ledger, and the export of one member as a
standard PEFT adapter. Serving a bundle in ``batch-run`` is
``mlora.batch.adapters.bundles``' job.

A bundle is a directory, written through ``mlora.lora_tools.atomic`` (a
temporary sibling renamed into place; an existing path is never overwritten),
its files read-only::

    bundle.json          format, schema_version, base identity, members in order with
                         their digests, options (method, R, clusters, normalisation,
                         iterations, tolerance, gate, seed), per-module clusters,
                         assignments, basis digests, errors and ledger, the total
                         ledger with break-even n, tensor digests, bundle_sha256
    bases.safetensors    "<module>/cluster<c>/U" [d_out, R], ".../V" [d_in, R]   (float32)
    cores.safetensors    "<module>/<member>" [R, R] (jd-full) or [R] (jd-diag)   (float32)

Member i's update at a module is ``U_c core_i V_c^T`` with ``c`` its cluster
there (``core`` the diagonal for JD-Diag), in the original units (norms
restored). Every tensor's digest is sha256 over the same canonical
dtype/shape prefix plus bytes as mlora's adapter digests; a basis digest binds
U and V of one cluster; ``bundle_sha256`` is sha256 of the canonical JSON of
everything else in bundle.json, so any edit, truncation or swapped tensor is
caught by :func:`read_bundle` (``E_BUNDLE_TAMPERED``, ``E_BUNDLE_MISSING``).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch

from mlora.compress.cluster import ClusterResult, auto_clusters, cluster
from mlora.compress.collection import Collection
from mlora.compress.ledger import module_ledger, total_ledger
from mlora.compress.solvers import METHODS, CompressError, FactoredDelta
from mlora.lora_tools.atomic import atomic_directory, check_new
from mlora.lora_tools.canonical import sealed_digest, sha256_hex
from mlora.lora_tools.safetensors_io import tensor_sha256

FORMAT = "mlora-collection-bundle/1"
_ST_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass
class CompressOptions:
    method: str = "jd-full"
    rank: int = 16
    clusters: int | str = 1  # an int, or "auto": the smallest K meeting max_error
    normalize: bool = True
    iters: int = 10
    tol: float = 1e-6
    max_error: float = 0.6
    seed: int = 0
    device: str = "cpu"

    def check(self) -> None:
        if self.method not in METHODS:
            raise CompressError("E_COMPRESS_METHOD", f"--method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.rank < 1:
            raise CompressError("E_COMPRESS_RANK", f"--rank must be >= 1, got {self.rank}")
        if self.clusters != "auto" and (not isinstance(self.clusters, int) or self.clusters < 1):
            raise CompressError("E_COMPRESS_CLUSTERS", f"--clusters takes a positive integer or 'auto', got {self.clusters!r}")
        if not self.max_error > 0:
            raise CompressError("E_COMPRESS_MAX_ERROR", f"--max-error must be positive, got {self.max_error}")


@dataclass
class ModuleFit:
    module: str
    d_in: int
    d_out: int
    members: list[str]  # member ids present at this module, collection order
    result: ClusterResult
    ledger: object = None
    seconds: float = 0.0  # wall time of reading and fitting this module

    def error_of(self) -> dict[str, float]:
        return dict(zip(self.members, self.result.errors))


@dataclass
class Compressed:
    collection: Collection
    options: CompressOptions
    fits: list[ModuleFit] = field(default_factory=list)

    def offenders(self) -> list[tuple[str, str, float]]:
        """(member, module, error) over ``max_error``, worst first."""
        bad = [(m, f.module, e) for f in self.fits for m, e in f.error_of().items()
               if not e <= self.options.max_error]
        return sorted(bad, key=lambda x: (-x[2] if math.isfinite(x[2]) else -math.inf, x[0], x[1]))

    def worst_error(self) -> dict[str, float]:
        """Each member's largest error over its modules."""
        out: dict[str, float] = {}
        for f in self.fits:
            for m, e in f.error_of().items():
                out[m] = max(out.get(m, 0.0), e)
        return out


def compress(col: Collection, o: CompressOptions, progress=None) -> Compressed:
    """Fit every module of ``col`` independently (docs/compress.md, The command). A module with fewer
    members than ``--clusters`` gets one cluster per member."""
    o.check()
    if not col.modules:
        raise CompressError("E_COMPRESS_EMPTY", "the collection has no adapted modules")
    out = Compressed(col, o)
    fit_args = dict(seed=o.seed, iters=o.iters, tol=o.tol, normalize=o.normalize, device=o.device)
    for module in sorted(col.modules, key=_module_order):
        started = time.perf_counter()
        ids, factors = col.factors(module)
        if o.device != "cpu":  # once per module: every fit and error pass below reuses the device copies
            factors = [FactoredDelta(f.A.to(o.device), f.B.to(o.device), f.scale) for f in factors]
        d_out, d_in = int(factors[0].B.shape[0]), int(factors[0].A.shape[1])
        if o.method == "jd-full" and o.rank > min(d_in, d_out):
            raise CompressError("E_COMPRESS_RANK", f"{module}: JD-Full rank {o.rank} exceeds min(d_in, d_out) = "
                                f"{min(d_in, d_out)}")
        if o.clusters == "auto":
            res = auto_clusters(factors, o.rank, o.max_error, o.method, **fit_args)
        else:
            res = cluster(factors, o.rank, min(int(o.clusters), len(factors)), o.method, **fit_args)
        fit = ModuleFit(module, d_in, d_out, ids, res, seconds=time.perf_counter() - started)
        fit.ledger = module_ledger(d_in, d_out, [f.rank for f in factors], o.rank, o.method, res.K)
        out.fits.append(fit)
        if progress:
            progress(fit)
    return out


def _module_order(name: str):
    """model.layers.<i>.… sorted by layer number, then name."""
    parts = name.split(".")
    for j, p in enumerate(parts[:-1]):
        if p == "layers" and parts[j + 1].isdigit():
            return (int(parts[j + 1]), name)
    return (-1, name)


# ---------------------------------------------------------------- writing


def _digest(t: torch.Tensor) -> str:
    t = t.detach().to("cpu").contiguous()
    return tensor_sha256(_ST_DTYPE[t.dtype], tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy())


def _member_config(path: str) -> dict:
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        cfg = {}
    return {"base_model_name_or_path": cfg.get("base_model_name_or_path"), "revision": cfg.get("revision")}


def bundle_tensors(c: Compressed) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(bases, cores) as named float32 tensors (see the module docstring)."""
    bases, cores = {}, {}
    for f in c.fits:
        for k, fit in enumerate(f.result.fits):
            bases[f"{f.module}/cluster{k}/U"] = fit.U.detach().to("cpu", torch.float32).contiguous()
            bases[f"{f.module}/cluster{k}/V"] = fit.V.detach().to("cpu", torch.float32).contiguous()
            for j, i in enumerate(f.result.members[k]):
                cores[f"{f.module}/{f.members[i]}"] = fit.cores[j].detach().to("cpu", torch.float32).contiguous()
    return bases, cores


def bundle_manifest(c: Compressed, bases: dict, cores: dict) -> dict:
    o = c.options
    digests = {name: _digest(t) for name, t in {**bases, **cores}.items()}
    modules = {}
    for f in c.fits:
        r = f.result
        modules[f.module] = {
            "d_in": f.d_in, "d_out": f.d_out, "clusters": r.K,
            "assignments": {f.members[i]: r.assignments[i] for i in range(len(f.members))},
            "basis_sha256": [sha256_hex((digests[f"{f.module}/cluster{k}/U"] + digests[f"{f.module}/cluster{k}/V"]).encode())
                             for k in range(r.K)],
            "errors": {m: _num(e) for m, e in f.error_of().items()},
            "rounds": r.rounds, "converged": r.converged,
            "iterations": [fit.iterations for fit in r.fits],
            "ledger": _ledger_json(f.ledger),
        }
    total = _total([f.ledger for f in c.fits])
    man = {
        "format": FORMAT,
        "schema_version": 1,
        "kind": "mlora-collection-bundle",
        "base_sha256": c.collection.base_sha256,
        "members": [{"id": m.id, "artifact_sha256": m.artifact_sha256, "semantic_sha256": m.semantic_sha256,
                     **_member_config(m.path)} for m in c.collection.members],
        "options": {"method": o.method, "rank": o.rank, "clusters": o.clusters, "normalize": o.normalize,
                    "iters": o.iters, "tol": o.tol, "max_error": o.max_error, "seed": o.seed},
        "modules": modules,
        "max_error_by_member": {m: _num(e) for m, e in c.worst_error().items()},
        "ledger": total,
        "tensors": digests,
    }
    man["bundle_sha256"] = sealed_digest(man, "bundle_sha256")
    return man


def _total(ledgers) -> dict:
    """The whole-collection ledger (``mlora.compress.ledger``). Its break-even n needs every module to
    count the same members; when members adapt different module sets the counts are
    summed and ``break_even_n`` is None."""
    try:
        return {k: (str(v) if not isinstance(v, (int, type(None))) else v) for k, v in asdict(total_ledger(ledgers)).items()}
    except CompressError as exc:
        if exc.code != "E_COMPRESS_SHAPE":
            raise
    keys = ("lora_params", "shared_params", "core_params", "payload_params", "paper_params")
    out = {k: sum(getattr(m, k) for m in ledgers) for k in keys}
    return {"modules": len(ledgers), "n": max(m.n for m in ledgers), **out, "break_even_n": None,
            "note": "members adapt different module sets: no single break-even n"}


def _num(x: float):
    return x if math.isfinite(x) else str(x)


def _ledger_json(ledger) -> dict:
    return {k: (str(v) if not isinstance(v, (int, str, type(None))) else v) for k, v in asdict(ledger).items()}


def _bundle_exists(path: str, during: bool) -> CompressError:
    return CompressError("E_BUNDLE_EXISTS", f"{path} {'appeared while writing' if during else 'exists'}; "
                         "bundles are immutable: choose a new path")


def _export_exists(path: str, during: bool) -> CompressError:
    return CompressError("E_EXPORT_EXISTS", f"{path} {'appeared while writing' if during else 'exists'}; "
                         "choose a new directory")


def write_bundle(c: Compressed, out: str) -> dict:
    """Write the bundle to ``out`` atomically; returns bundle.json's content.
    Refuses an existing ``out`` (E_BUNDLE_EXISTS) and a bundle over the gate (E_COMPRESS_MAX_ERROR)."""
    from safetensors.torch import save_file

    out = check_new(out, _bundle_exists)
    bad = c.offenders()
    if bad:
        raise CompressError("E_COMPRESS_MAX_ERROR", f"{len(bad)} member/module error(s) exceed --max-error "
                            f"{c.options.max_error}; no bundle written")
    bases, cores = bundle_tensors(c)
    man = bundle_manifest(c, bases, cores)
    with atomic_directory(out, _bundle_exists) as tmp:
        save_file(bases, os.path.join(tmp, "bases.safetensors"), metadata={"format": "pt"})
        save_file(cores, os.path.join(tmp, "cores.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "bundle.json"), "w") as f:
            json.dump(man, f, indent=1, sort_keys=True)
            f.write("\n")
    return man


# ---------------------------------------------------------------- reading


@dataclass
class Bundle:
    path: str
    manifest: dict
    bases: dict[str, torch.Tensor]
    cores: dict[str, torch.Tensor]

    @property
    def method(self) -> str:
        return self.manifest["options"]["method"]

    def member_ids(self) -> list[str]:
        return [m["id"] for m in self.manifest["members"]]

    def member_delta(self, member: str, module: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(B' = U core [d_out, R], A' = V^T [R, d_in]) with ``B' A'`` the member's compressed
        update at ``module``; None where the member does not adapt it."""
        mod = self.manifest["modules"][module]
        if member not in mod["assignments"]:
            return None
        c = mod["assignments"][member]
        U, V = self.bases[f"{module}/cluster{c}/U"], self.bases[f"{module}/cluster{c}/V"]
        core = self.cores[f"{module}/{member}"]
        core = torch.diag(core) if core.dim() == 1 else core
        return U @ core, V.T.contiguous()


def read_bundle(path: str) -> Bundle:
    """Load a bundle and verify bundle_sha256 and every tensor digest."""
    from safetensors.torch import load_file

    try:
        with open(os.path.join(path, "bundle.json")) as f:
            man = json.load(f)
    except FileNotFoundError:
        raise CompressError("E_BUNDLE_MISSING", f"{path} has no bundle.json: not a bundle") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CompressError("E_BUNDLE_TAMPERED", f"{path}/bundle.json cannot be read: {e}") from None
    if man.get("format") != FORMAT:
        raise CompressError("E_BUNDLE_FORMAT", f"{path}: format {man.get('format')!r}, this mlora reads {FORMAT!r}")
    if sealed_digest(man, "bundle_sha256") != man.get("bundle_sha256"):
        raise CompressError("E_BUNDLE_TAMPERED", f"{path}/bundle.json does not hash to its bundle_sha256: edited")
    tensors = {}
    for file in ("bases.safetensors", "cores.safetensors"):
        full = os.path.join(path, file)
        if not os.path.exists(full):
            raise CompressError("E_BUNDLE_MISSING", f"{path}: {file} is missing")
        try:
            tensors[file] = load_file(full)
        except Exception as e:  # safetensors raises its own types for truncated files
            raise CompressError("E_BUNDLE_TAMPERED", f"{full} cannot be read ({e}): truncated or corrupt") from None
    everything = {**tensors["bases.safetensors"], **tensors["cores.safetensors"]}
    if set(everything) != set(man["tensors"]):
        raise CompressError("E_BUNDLE_TAMPERED", f"{path}: the tensor names differ from bundle.json's")
    for name, t in everything.items():
        if _digest(t) != man["tensors"][name]:
            raise CompressError("E_BUNDLE_TAMPERED", f"{path}: tensor {name!r} does not match its digest")
    return Bundle(path, man, tensors["bases.safetensors"], tensors["cores.safetensors"])


# ---------------------------------------------------------------- export


def export_member(bundle: Bundle, member: str, out: str) -> dict:
    """Write ``member``'s compressed update as a PEFT LoRA adapter of rank R (lora_B = U core,
    lora_A = V^T, alpha = R so the scale is 1) into ``out`` (atomically, never overwriting)."""
    from safetensors.torch import save_file

    if member not in bundle.member_ids():
        raise CompressError("E_BUNDLE_MEMBER", f"{member!r} is not a member of {bundle.path}; members: "
                            f"{', '.join(bundle.member_ids())}")
    out = check_new(out, _export_exists)
    R = int(bundle.manifest["options"]["rank"])
    tensors, targets = {}, []
    for module in bundle.manifest["modules"]:
        pair = bundle.member_delta(member, module)
        if pair is None:
            continue
        b, a = pair
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
        targets.append(module)
    info = next(m for m in bundle.manifest["members"] if m["id"] == member)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": R, "lora_alpha": R, "target_modules": sorted(targets),
        "base_model_name_or_path": info.get("base_model_name_or_path"), "revision": info.get("revision"),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "lora_dropout": 0.0,
        "inference_mode": True,
    }
    with atomic_directory(out, _export_exists, read_only=False) as tmp:
        save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=1)
    return {"member": member, "modules": len(targets), "rank": R, "path": out,
            "bundle_sha256": bundle.manifest["bundle_sha256"]}
