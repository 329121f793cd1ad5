"""Adapter identities: artifact, activation policy, semantic (docs/design.md, Artifact identity,
Semantic identity).

Owns the three digest formulas below; every byte they cover is documented in
docs/identity.md so another implementation can reproduce them::

    artifact_sha256 = SHA256(canonical({
        "schema": "mlora.artifact/v1", "method": "lora",
        "peft_config_sha256": ..., "modules": [module_spec, ... sorted by name],
        "extra_tensors": [{name, dtype, shape, sha256}, ... sorted by name]}))
    activation_policy_sha256 = SHA256(canonical({"kind": "always_on"}))      # or aLoRA tokens
    semantic_sha256 = SHA256(canonical({"base_sha256": H_base,
        "artifact_sha256": ..., "activation_policy_sha256": ...}))

The base is bound in the semantic identity, not in the artifact identity:
the artifact identity stays computable from the adapter alone (so ``mlora
hash`` needs no base), and one adapter has one artifact digest everywhere.
H_base is the measured ``base_sha256`` when a base is given and otherwise the
*declared* base digest below; manifests say which (``base.binding``:
``measured`` or ``declared``).
"""

from __future__ import annotations

from mlora.lora_tools.canonical import digest

ARTIFACT_SCHEMA = "mlora.artifact/v1"


def artifact_sha256(peft_config_sha256: str, module_specs: list[dict], extra_tensors: list[dict]) -> str:
    return digest(
        {
            "schema": ARTIFACT_SCHEMA,
            "method": "lora",
            "peft_config_sha256": peft_config_sha256,
            "modules": sorted(module_specs, key=lambda m: m["name"]),
            "extra_tensors": sorted(extra_tensors, key=lambda t: t["name"]),
        }
    )


def declared_base_sha256(name: str | None, revision: str | None) -> str:
    """Stand-in for H_base when only the adapter's declared base is known."""
    return digest({"declared_base": {"name": name, "revision": revision}})


def semantic_sha256(base_sha256: str, artifact: str, activation_policy_sha256: str) -> str:
    return digest(
        {
            "base_sha256": base_sha256,
            "artifact_sha256": artifact,
            "activation_policy_sha256": activation_policy_sha256,
        }
    )
