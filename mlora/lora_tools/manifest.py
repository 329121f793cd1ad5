"""The adapter manifest (``mlora validate --json`` / ``mlora hash --json``).

Owns the manifest's JSON shape (``schema_version`` 1, docs/identity.md, "The adapter
manifest") and the one entry point that turns paths into manifests:
:func:`inspect_paths`. The CLI only renders what this returns.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mlora.lora_tools.adapter import (
    AdapterArtifact,
    ModuleRecord,
    check_against_base,
    discover_adapters,
    open_adapter,
    rank_histogram,
    scan_adapters,
)
from mlora.lora_tools.base import BaseCheckpoint, BaseCheckpointError, BaseIdentity
from mlora.lora_tools.canonical import canonical_real, digest
from mlora.lora_tools.findings import ERROR, UNSERVABLE, WARNING, Finding, finding
from mlora.lora_tools.identity import artifact_sha256, declared_base_sha256, semantic_sha256

SCHEMA_VERSION = 1


def module_spec(rec: ModuleRecord) -> dict:
    """The canonical ``module_spec`` (docs/identity.md, Module record; hashed into artifact_sha256)."""
    return {
        "name": rec.name,
        "kind": rec.kind,
        "role": rec.role,
        "layer": rec.layer,
        "base_weight_shape": [rec.d_out, rec.d_in],
        "rank": rec.rank,
        "alpha": canonical_real(rec.alpha),
        "scale_rule": rec.scale_rule,
        "scale": canonical_real(rec.scale),
        "a": {"axes": ["rank", "input"], "shape": list(rec.a.shape), "dtype": rec.a.dtype, "sha256": rec.a_sha256},
        "b": {"axes": ["output", "rank"], "shape": list(rec.b.shape), "dtype": rec.b.dtype, "sha256": rec.b_sha256},
    }


@dataclass
class AdapterReport:
    artifact: AdapterArtifact
    manifest: dict

    @property
    def findings(self) -> list[Finding]:
        return self.artifact.findings

    @property
    def valid(self) -> bool:
        return self.manifest["valid"]

    @property
    def servable(self) -> bool:
        return self.manifest["servable"]

    def passes(self, strict: bool = False) -> bool:
        """Exit-code rule: no error and no unservable finding (and, strict, no warning)."""
        bad = {ERROR, UNSERVABLE} | ({WARNING} if strict else set())
        return not any(f.severity in bad for f in self.findings)


def build_manifest(art: AdapterArtifact, base: BaseIdentity | None) -> dict:
    spec = art.spec
    valid = spec is not None and art.scanned and not art.has_errors
    servable = valid and not any(f.severity == UNSERVABLE for f in art.findings)
    identity: dict = {
        "peft_config_sha256": None, "artifact_sha256": None, "activation_policy": None,
        "activation_policy_sha256": None, "semantic_sha256": None,
    }
    base_block = {
        "declared_name": spec.base_model_name_or_path if spec else None,
        "declared_revision": spec.revision if spec else None,
        "binding": "measured" if base else "declared",
        "base_sha256": base.base_sha256 if base else None,
    }
    if valid:
        assert spec is not None
        peft_cfg = digest(spec.semantic_projection())
        extras = [
            {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "sha256": art.extra_sha256[t.name]}
            for t in art.extra.values()
        ]
        art_digest = artifact_sha256(peft_cfg, [module_spec(m) for m in art.modules], extras)
        policy = spec.activation_policy()
        policy_digest = digest(policy)
        h_base = base.base_sha256 if base else declared_base_sha256(spec.base_model_name_or_path, spec.revision)
        base_block["base_sha256"] = h_base
        identity = {
            "peft_config_sha256": peft_cfg,
            "artifact_sha256": art_digest,
            "activation_policy": policy,
            "activation_policy_sha256": policy_digest,
            "semantic_sha256": semantic_sha256(h_base, art_digest, policy_digest),
        }
    modules = sorted(art.modules, key=lambda m: m.name)
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "mlora.adapter_manifest",
        "name": art.name,
        "path": os.path.abspath(art.path),
        "format": art.format,
        "method": "lora",
        "base": base_block,
        **identity,
        "modules": [
            {
                **{k: v for k, v in module_spec(m).items() if k not in ("a", "b", "alpha", "scale")},
                "d_in": m.d_in,
                "d_out": m.d_out,
                "alpha": m.alpha,
                "scale": m.scale,
                "dtype": m.dtype,
                "a_sha256": m.a_sha256,
                "b_sha256": m.b_sha256,
            }
            for m in modules
        ],
        "stats": {
            "modules": len(modules),
            "parameters": sum(m.parameters for m in modules),
            "bytes": sum(m.a.nbytes + m.b.nbytes for m in modules) + sum(t.nbytes for t in art.extra.values()),
            "rank_histogram": rank_histogram(art),
        },
        "valid": valid,
        "servable": servable,
        "findings": [f.to_json() for f in art.findings],
    }


class BaseLoadError(Exception):
    """The --base directory is unusable; ``finding`` says why (E_BASE_INVALID)."""

    def __init__(self, f: Finding):
        super().__init__(f.message)
        self.finding = f


def load_base(path: str) -> BaseCheckpoint:
    try:
        return BaseCheckpoint(path)
    except BaseCheckpointError as exc:
        raise BaseLoadError(finding("E_BASE_INVALID", str(exc))) from None


def base_identity(base: BaseCheckpoint, workers: int | None = None) -> BaseIdentity:
    """``base.identity()`` with unreadable tensors reported as BaseLoadError."""
    try:
        return base.identity(workers)
    except BaseCheckpointError as exc:
        raise BaseLoadError(finding("E_BASE_INVALID", str(exc))) from None


def inspect_paths(
    paths: list[str],
    base_path: str | None = None,
    allow_pickle: bool = False,
    workers: int | None = None,
) -> tuple[list[AdapterReport], BaseIdentity | None]:
    """Validate and identify every adapter named by ``paths`` (adapter
    directories or directories of them), optionally against a base.
    Raises BaseLoadError when ``base_path`` is not a usable checkpoint."""
    base = load_base(base_path) if base_path else None
    arts: list[AdapterArtifact] = []
    for p in paths:
        found = discover_adapters(p)
        if found is None:
            art = AdapterArtifact(path=p, name=os.path.basename(os.path.normpath(p)))
            art.add(finding("E_NOT_AN_ADAPTER", f"{p} holds no adapter_config.json and no adapter sub-directories"))
            arts.append(art)
            continue
        arts.extend(open_adapter(a, allow_pickle) for a in found)
    scan_adapters(arts, workers)
    base_id = None
    if base is not None:
        for art in arts:
            check_against_base(art, base)
        base_id = base_identity(base, workers)
    return [AdapterReport(a, build_manifest(a, base_id)) for a in arts], base_id
