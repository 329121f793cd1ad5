"""Serving collection-bundle members in a batch job (docs/design.md, Bundle and three-stage operator).

Owns the catalog entries of a bundle passed as ``--adapters BUNDLE``, the
pinning of its members, and the verified factors of a member. Must not know
slots or the model beyond the base config's projection shapes.

A member is served as the rank-R LoRA update it stands for: at each module
it adapts, ``B' = U_c core_i`` [d_out, R] and ``A' = V_c^T`` [R, d_in] with
scale 1, exactly the factors ``mlora compress export`` writes, so a member's
output equals serving its exported adapter (bit for bit: the same float32
products). The bundle is read and every digest verified at pin time (every
job start; ``mlora.compress.bundle.read_bundle``); those verified tensors stay
in memory, keyed by the bundle's digest, so a member is served with the bytes
its identity was pinned with even if the files change later.

This module gives the materialised form (``member_factors``: each member's
factors in an ordinary slot; correct, but no memory saved over the
uncompressed adapters). A job whose adapters all come from one bundle is
served with the three-stage operator instead (``mlora.batch.adapters.bundle_bank``,
``--bundle-operator``), from the same verified tensors (``pinned_bundle``).

Identity: ``artifact_sha256`` is the bundle's ``bundle_sha256``;
``semantic_sha256`` hashes (bundle_sha256, member id, the job's base
identity) in the spaced form of ``mlora.lora_tools.canonical``, so two
members, or one member over two bases, never share a slot. A member is
always on (``invocation_tokens`` None): ``mlora compress`` refuses aLoRA members.
"""

from __future__ import annotations

import json
import os

import torch

from mlora.batch.adapters.pinned import (
    AdapterChanged,
    AdapterError,
    CatalogEntry,
    CatalogError,
    PinnedAdapter,
    PinnedModule,
    TensorRef,
    unsupported_module,
)
from mlora.batch.model.decoder import load_config
from mlora.batch.model.lora import config_role_shapes, module_layer_role
from mlora.compress.bundle import read_bundle
from mlora.compress.solvers import CompressError
from mlora.lora_tools.canonical import spaced_digest

# (bundle directory, bundle_sha256) -> the Bundle verified when a job pinned it
_BUNDLES: dict[tuple[str, str], object] = {}


def bundle_entries(root: str) -> dict[str, CatalogEntry]:
    """One catalog entry per member of the bundle at ``root`` (ids from bundle.json, in order)."""
    try:
        with open(os.path.join(root, "bundle.json")) as f:
            members = [m["id"] for m in json.load(f)["members"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CatalogError("E_CATALOG_INVALID", f"--adapters {root}: bundle.json cannot be read ({exc}); "
                           "check it with `mlora compress inspect`") from None
    path = os.path.abspath(root)
    return {m: CatalogEntry(m, path, bundle_member=m) for m in members}


def _verified(path: str):
    """Read and verify the bundle now (every job start does), and keep it for the job's loads."""
    b = read_bundle(path)
    _BUNDLES[(path, b.manifest["bundle_sha256"])] = b
    return b


def pin_members(entries: list[CatalogEntry], base_dir: str, base_identity) -> dict[str, PinnedAdapter]:
    """Pin bundle members: the bundle verified (a tampered bundle makes every member an
    error), every module's shape checked against the base."""
    config = load_config(base_dir)
    expected = config_role_shapes(config)
    out: dict[str, PinnedAdapter] = {}
    # each bundle is read and verified once per pin, however many of its members the job
    # names: once per member, pinning a large bundle would hash it members x bundle bytes
    verified: dict[str, tuple[object, set[str]] | CompressError] = {}
    for e in entries:
        def bad(code: str, message: str) -> PinnedAdapter:
            return PinnedAdapter(e.id, e.path, False, code, message, bundle=e.path, bundle_member=e.bundle_member)

        if e.path not in verified:
            try:
                b = _verified(e.path)
                verified[e.path] = (b, set(b.member_ids()))
            except CompressError as exc:
                verified[e.path] = exc
        got = verified[e.path]
        if isinstance(got, CompressError):
            out[e.id] = bad(got.code, f"bundle {e.path}: {got.message}")
            continue
        b, member_set = got
        man = b.manifest
        if e.bundle_member not in member_set:
            out[e.id] = bad("E_ADAPTER_UNKNOWN", f"{e.bundle_member!r} is not a member of the bundle {e.path}; "
                            f"members: {', '.join(b.member_ids())}")
            continue
        R = int(man["options"]["rank"])
        modules, problem = [], None
        for name, mod in man["modules"].items():
            if e.bundle_member not in mod["assignments"]:
                continue
            layer, role = module_layer_role(name)
            problem = unsupported_module(name, "linear", role, layer)
            shape = expected.get(role)
            if problem is None and (layer >= config.num_layers or shape != (mod["d_out"], mod["d_in"])):
                problem = (f"module {name} is [{mod['d_out']}, {mod['d_in']}] in the bundle, the base has "
                           f"{'no such layer' if layer >= config.num_layers else list(shape)}")
            if problem:
                break
            c = mod["assignments"][e.bundle_member]
            core = f"{name}/{e.bundle_member}"
            v = f"{name}/cluster{c}/V"
            modules.append(PinnedModule(
                name=name, layer=layer, role=role, rank=R, scale=1.0, d_in=mod["d_in"], d_out=mod["d_out"],
                # the materialised factors: A' = V^T from the cluster's V, B' = U core from the member's core
                a=TensorRef(v, e.path, 0, 4 * R * mod["d_in"], "F32", (R, mod["d_in"]), man["tensors"][v]),
                b=TensorRef(core, e.path, 0, 4 * R * mod["d_out"], "F32", (mod["d_out"], R), man["tensors"][core]),
            ))
        if problem:
            out[e.id] = bad("E_ADAPTER_MODULE_UNSUPPORTED", f"bundle member {e.id!r}: {problem}")
            continue
        if not modules:
            out[e.id] = bad("E_ADAPTER_INVALID", f"bundle member {e.id!r} adapts no module")
            continue
        semantic = spaced_digest({"kind": "mlora-bundle-member", "bundle_sha256": man["bundle_sha256"],
                                  "member": e.bundle_member, "base_sha256": base_identity.base_sha256})
        out[e.id] = PinnedAdapter(e.id, e.path, True, artifact_sha256=man["bundle_sha256"], semantic_sha256=semantic,
                                  max_rank=R, modules=tuple(modules), bundle=e.path, bundle_member=e.bundle_member)
    return out


def pinned_bundle(pinned: PinnedAdapter):
    """The verified Bundle a member was pinned from: the one read at pin time in this
    process, or (pinned in another process) read and verified again, and refused
    (AdapterChanged) unless it is still the bundle pinned at job start."""
    b = _BUNDLES.get((pinned.bundle, pinned.artifact_sha256))
    if b is None:
        try:
            b = _verified(pinned.bundle)
        except Exception as exc:
            raise AdapterChanged(pinned.id, f"bundle {pinned.bundle} cannot be read ({exc})") from None
        if b.manifest["bundle_sha256"] != pinned.artifact_sha256:
            raise AdapterChanged(pinned.id, f"bundle {pinned.bundle} is not the bundle pinned at job start")
    return b


def member_factors(pinned: PinnedAdapter, dtype: torch.dtype, device) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]:
    """(layer, role) -> (A' [R, d_in], B' [d_out, R], 1.0) of a pinned bundle member."""
    b = pinned_bundle(pinned)
    member = pinned.bundle_member
    if member not in b.member_ids():
        raise AdapterError("E_ADAPTER_UNKNOWN", f"{member!r} is not a member of {pinned.bundle}", pinned.id)
    out = {}
    for m in pinned.modules:
        bb, aa = b.member_delta(member, m.name)
        out[(m.layer, m.role)] = (aa.to(device=device, dtype=dtype), bb.to(device=device, dtype=dtype), 1.0)
    return out
