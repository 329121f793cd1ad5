"""A pinned adapter: an adapter id frozen to its content identity at job start.

Owns the records the catalog (``mlora.batch.adapters.catalog``) and the bundle
members (``mlora.batch.adapters.bundles``) are pinned into -- where each factor's
bytes lie and the digests they must hash to -- the errors of serving one, and the
rule of which modules the batch engine serves. Reads no file.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlora.batch.errors import CodedError
from mlora.batch.model.lora import ROLE_SLICE, module_name
from mlora.lora_tools.findings import Finding


class CatalogError(CodedError, ValueError):
    """The catalog itself is unusable (the job cannot start). ``code`` is one of
    E_CATALOG_NOT_FOUND, E_CATALOG_INVALID, E_CATALOG_EMPTY."""


class AdapterError(CodedError, RuntimeError):
    """A pinned adapter cannot be served; ``code`` says why."""

    def __init__(self, code: str, message: str, adapter_id: str | None = None):
        super().__init__(code, message)
        self.adapter_id = adapter_id


class AdapterChanged(AdapterError):
    """The bytes on disk no longer hash to the digests pinned at job start."""

    def __init__(self, adapter_id: str, detail: str):
        super().__init__(
            "E_ADAPTER_CHANGED",
            f"adapter {adapter_id!r}: {detail}; adapter bytes changed since the job started; the old identity is "
            "never served: restore the adapter or start a new job",
            adapter_id,
        )


@dataclass(frozen=True)
class CatalogEntry:
    id: str
    path: str  # absolute
    expected_artifact_sha256: str | None = None
    bundle_member: str | None = None  # set: ``path`` is a collection bundle and this is the member's id there


@dataclass(frozen=True)
class TensorRef:
    """Where one factor's bytes lie and the tensor digest they must hash to."""

    name: str
    path: str
    offset: int
    nbytes: int
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    sha256: str
    pickled: bool = False  # ``path`` is an adapter_model.bin (--allow-pickle) and ``name`` its state-dict key


@dataclass(frozen=True)
class PinnedModule:
    name: str  # canonical module name, e.g. model.layers.3.self_attn.q_proj
    layer: int
    role: str  # q_proj ... down_proj
    rank: int
    scale: float
    d_in: int
    d_out: int
    a: TensorRef  # [rank, d_in]
    b: TensorRef  # [d_out, rank]


@dataclass(frozen=True)
class PinnedAdapter:
    """One catalog id as pinned at job start. ``modules`` is empty unless ``ok``."""

    id: str
    path: str | None
    ok: bool
    error_code: str | None = None
    error_message: str | None = None
    artifact_sha256: str | None = None
    semantic_sha256: str | None = None
    max_rank: int = 0
    modules: tuple[PinnedModule, ...] = ()
    findings: tuple[Finding, ...] = ()
    bundle: str | None = None  # a collection bundle member (``mlora.batch.adapters.bundles``): the bundle directory
    bundle_member: str | None = None  # ... and the member's id in that bundle
    # activated LoRA (aLoRA): the invocation token ids; the adapter applies from the start of their
    # last occurrence in the prompt on (model/prefix.alora_activation_start); None: from position 0
    invocation_tokens: tuple[int, ...] | None = None


def unsupported_module(name: str, kind: str, role: str, layer: int | None) -> str | None:
    """Why the batch engine cannot serve this module (None when it can): only
    linear q/k/v/o/gate/up/down projections of numbered decoder layers, named
    as in Hugging Face Llama-family models."""
    if kind != "linear" or role not in ROLE_SLICE or layer is None:
        return (f"module {name!r} is not served by the batch engine; it serves LoRA on the q/k/v/o/gate/up/down "
                "projections of decoder layers only: retrain without it or merge it with `mlora merge`")
    expected = module_name(layer, role)
    if name != expected:
        return (f"module {name!r} is not a decoder-layer projection (expected {expected}); "
                "the batch engine serves Llama-family decoders only")
    return None
