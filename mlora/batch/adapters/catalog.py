"""The adapter catalog of a batch job: ids -> adapter directories, pinned by digest.

Owns ``--adapters DIR`` / ``--catalog FILE`` parsing, the pinning of every
adapter a job references (validated once, at job start, with the
``mlora.lora_tools`` code behind ``mlora validate``: same findings, same
identities) and the verified reading of a pinned adapter's factors
(docs/design.md, Pinning). Must not know slots or the model: the slot bank
(``mlora.batch.adapters.slots``) places what :func:`load_factors` returns.

Pinning freezes an adapter's identity: ``artifact_sha256``, ``semantic_sha256``
and, per module, where its A/B bytes lie and their tensor digests
(docs/identity.md). :func:`load_factors` re-hashes the bytes it reads and
refuses any that changed (``E_ADAPTER_CHANGED``): a job serves the identity it
pinned or nothing. An ``adapter_model.bin`` adapter is read only when the job
allows pickles (``allow_pickle``: ``batch-run --allow-pickle``, the same
``torch.load(weights_only=True)`` as ``mlora validate --allow-pickle``), else it
pins as ``E_PICKLE_REFUSED``; its factors are re-read from the pickle and
re-hashed alike. A bad adapter never raises at pin time; it becomes a
``PinnedAdapter`` with ``ok=False`` and one error code, and the job decides
(error rows, or exit 1 with ``--strict``).
An aLoRA adapter pins its ``invocation_tokens`` too (docs/identity.md,
Activation policy): the engine activates it per row from them.

Error code of a bad adapter, first match wins::

    E_ADAPTER_UNKNOWN              the id is not in the catalog
    <first error finding>          not a valid adapter for this base (E_NON_FINITE, ...)
    E_ADAPTER_DIGEST_MISMATCH      the catalog's expected artifact_sha256 differs from the measured one
    <first unservable finding>     valid PEFT that mlora does not serve (U_DORA, ...)
    E_ADAPTER_MODULE_UNSUPPORTED   a module outside the decoder's q/k/v/o/gate/up/down projections
"""

from __future__ import annotations

import json
import os
import re

import torch

from mlora.batch.adapters.bundles import bundle_entries, member_factors, pin_members
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
from mlora.lora_tools.adapter import (
    CONFIG_FILE,
    PICKLE_FILE,
    SAFETENSORS_FILE,
    AdapterArtifact,
    MemTensor,
    check_against_base,
    load_pickle_tensors,
    open_adapter,
    scan_adapters,
)
from mlora.lora_tools.base import BaseIdentity
from mlora.lora_tools.findings import ERROR, UNSERVABLE, Finding, finding
from mlora.lora_tools.manifest import base_identity as measure_base
from mlora.lora_tools.manifest import build_manifest, load_base
from mlora.lora_tools.safetensors_io import TensorChanged, TensorInfo, read_verified

BASE_ID = "__base__"  # an adapter-column value that means "the base model on purpose"
MAX_CATALOG_BYTES = 64 * 1024 * 1024
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


# ---- catalog ---------------------------------------------------------------------


class Catalog:
    """Adapter id -> :class:`CatalogEntry`. Build it with :func:`load_catalog`."""

    def __init__(self, entries: dict[str, CatalogEntry], source: str):
        self.entries = entries
        self.source = source

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def ids(self) -> list[str]:
        return sorted(self.entries)

    def pin(
        self,
        ids: set[str],
        base_dir: str | None,
        workers: int | None = None,
        base_identity: BaseIdentity | None = None,
        allow_pickle: bool = False,
    ) -> dict[str, PinnedAdapter]:
        """Validate the adapters named by ``ids`` against the base once (all
        tensors streamed and hashed on one thread pool) and pin their
        identities. Pass ``base_identity`` when the job already measured it;
        ``allow_pickle`` reads ``adapter_model.bin`` adapters (refused otherwise).
        ``base_dir`` None: no checkpoint to check the adapters against (a benchmark's base
        generated in memory), the identities bound to the base the adapters declare.
        Raises ``mlora.lora_tools.manifest.BaseLoadError`` for an unusable base,
        ValueError for a reserved id; never for a bad adapter."""
        reserved = sorted(i for i in ids if i in (BASE_ID, "") or not isinstance(i, str))
        if reserved:
            raise ValueError(f"reserved ids {reserved} name the base model, not an adapter; do not pin them")
        base = load_base(base_dir) if base_dir is not None else None
        members = sorted(i for i in ids if i in self.entries and self.entries[i].bundle_member is not None)
        if members and base is None:
            raise ValueError("a bundle's members are checked against the base checkpoint: pin them with its base_dir")
        known = sorted(i for i in ids if i in self.entries and self.entries[i].bundle_member is None)
        arts: dict[str, AdapterArtifact] = {i: _open(self.entries[i].path, allow_pickle) for i in known}
        scan_adapters(list(arts.values()), workers)
        for art in arts.values():
            if base is not None:
                check_against_base(art, base)
        if base_identity is None and base is not None and (arts or members):
            base_identity = measure_base(base, workers)
        out = {i: PinnedAdapter(i, None, False, "E_ADAPTER_UNKNOWN", f"adapter {i!r} is not in the catalog: "
                                f"add it to {self.source} or fix the row's adapter column")
               for i in ids if i not in self.entries}
        for i, art in arts.items():
            out[i] = _pin_one(self.entries[i], art, base_identity)
        if members:
                out.update(pin_members([self.entries[i] for i in members], base_dir, base_identity))
        return out


def load_catalog(adapters_dir: str | None, catalog_file: str | None) -> Catalog:
    """The catalog of ``--adapters DIR`` or ``--catalog FILE`` (exactly one).

    DIR: every sub-directory that holds adapter files (adapter_config.json,
    adapter_model.safetensors or .bin) is an adapter whose id is the directory
    name; hidden directories are skipped. A DIR holding ``bundle.json`` is a
    collection bundle (``mlora compress``): its members are the adapters. FILE: a JSON object mapping id to a
    path, to ``{"path": ..., "artifact_sha256": ...}`` or to ``{"path": BUNDLE, "member": ID}``; relative paths are
    resolved against the catalog file's directory. Paths are not opened here:
    :meth:`Catalog.pin` validates the adapters a job actually uses."""
    if (adapters_dir is None) == (catalog_file is None):
        raise ValueError("give exactly one of --adapters DIR and --catalog FILE")
    if adapters_dir is not None:
        return _from_dir(adapters_dir)
    return _from_file(catalog_file)


def _from_dir(root: str) -> Catalog:
    if not os.path.isdir(root):
        raise CatalogError("E_CATALOG_NOT_FOUND", f"--adapters {root}: no such directory; pass the directory "
                           "that holds one sub-directory per adapter")
    if os.path.exists(os.path.join(root, "bundle.json")):  # a collection bundle: its members are the adapters
        return Catalog(bundle_entries(root), root)
    entries = {}
    for name in sorted(os.listdir(root)):
        path = os.path.abspath(os.path.join(root, name))
        if name.startswith(".") or not _has_adapter_files(path):
            continue
        _check_id(name, root)
        entries[name] = CatalogEntry(name, path)
    if not entries:
        hint = (" it is itself an adapter: pass its parent directory" if _has_adapter_files(root)
                else " put each adapter (adapter_config.json + adapter_model.safetensors) in its own sub-directory")
        raise CatalogError("E_CATALOG_EMPTY", f"--adapters {root} holds no adapter sub-directories;{hint}")
    return Catalog(entries, root)


def _from_file(file: str) -> Catalog:
    if not os.path.isfile(file):
        raise CatalogError("E_CATALOG_NOT_FOUND", f"--catalog {file}: no such file; pass a JSON file "
                           "mapping adapter ids to adapter directories")
    with open(file, "rb") as f:
        raw = f.read(MAX_CATALOG_BYTES + 1)
    if len(raw) > MAX_CATALOG_BYTES:
        raise CatalogError("E_CATALOG_INVALID", f"--catalog {file} is larger than {MAX_CATALOG_BYTES} bytes")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CatalogError("E_CATALOG_INVALID", f"--catalog {file} is not valid JSON ({exc}); it must be one "
                           "object mapping adapter ids to paths") from None
    if not isinstance(doc, dict):
        raise CatalogError("E_CATALOG_INVALID", f"--catalog {file} holds a JSON {type(doc).__name__}; it must be "
                           "one object mapping adapter ids to paths")
    if not doc:
        raise CatalogError("E_CATALOG_EMPTY", f"--catalog {file} names no adapters; add \"id\": \"path\" entries")
    here = os.path.dirname(os.path.abspath(file))
    entries = {}
    for adapter_id, value in doc.items():
        _check_id(adapter_id, file)
        path, expected, member = _entry_fields(adapter_id, value, file)
        path = os.path.join(here, os.path.expanduser(path))  # an absolute path stays as it is
        entries[adapter_id] = CatalogEntry(adapter_id, os.path.normpath(path), expected, member)
    return Catalog(entries, file)


def _entry_fields(adapter_id: str, value: object, file: str) -> tuple[str, str | None, str | None]:
    where = f"--catalog {file}, entry {adapter_id!r}"
    if isinstance(value, str):
        value = {"path": value}
    if not isinstance(value, dict):
        raise CatalogError("E_CATALOG_INVALID", f"{where}: expected a path string or "
                           "{\"path\": ..., \"artifact_sha256\": ...} or {\"path\": BUNDLE, \"member\": ID}")
    unknown = sorted(set(value) - {"path", "artifact_sha256", "member"})
    if unknown:
        raise CatalogError("E_CATALOG_INVALID", f"{where}: unknown keys {unknown}; only \"path\", "
                           "\"artifact_sha256\" and \"member\" are read")
    path, expected, member = value.get("path"), value.get("artifact_sha256"), value.get("member")
    if member is not None and (not isinstance(member, str) or not member or expected is not None):
        raise CatalogError("E_CATALOG_INVALID", f"{where}: \"member\" names a member of the bundle at \"path\" "
                           "(a non-empty string; a bundle member has no \"artifact_sha256\" of its own)")
    if not isinstance(path, str) or not path:
        raise CatalogError("E_CATALOG_INVALID", f"{where}: \"path\" must be a non-empty string")
    if expected is not None and not (isinstance(expected, str) and _SHA256_RE.match(expected)):
        raise CatalogError("E_CATALOG_INVALID", f"{where}: \"artifact_sha256\" must be 64 lower-case hex digits, "
                           "as `mlora hash` prints it")
    return path, expected, member


def _check_id(adapter_id: str, where: str) -> None:
    if adapter_id in ("", BASE_ID):
        raise CatalogError("E_CATALOG_INVALID", f"{where}: adapter id {adapter_id!r} is reserved (null, empty and "
                           f"{BASE_ID!r} mean the base model); rename the adapter")


def _has_adapter_files(path: str) -> bool:
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, f)) for f in (CONFIG_FILE, SAFETENSORS_FILE, PICKLE_FILE)
    )


# ---- pinning ---------------------------------------------------------------------


def _open(path: str, allow_pickle: bool) -> AdapterArtifact:
    if not os.path.isdir(path):
        art = AdapterArtifact(path=path, name=os.path.basename(os.path.normpath(path)))
        art.add(finding("E_NOT_AN_ADAPTER", f"{path} is not a directory"))
        return art
    return open_adapter(path, allow_pickle=allow_pickle)


def _pin_one(entry: CatalogEntry, art: AdapterArtifact, base_id: BaseIdentity) -> PinnedAdapter:
    manifest = build_manifest(art, base_id)
    found = tuple(art.findings)

    def bad(code: str, message: str) -> PinnedAdapter:
        return PinnedAdapter(entry.id, entry.path, False, code, message, manifest["artifact_sha256"],
                             manifest["semantic_sha256"], findings=found)

    if not manifest["valid"]:
        first = next((f for f in found if f.severity == ERROR), None)
        if first is None:
            return bad("E_ADAPTER_INVALID", f"adapter {entry.id!r} at {entry.path} is not valid")
        return bad(first.code, _where(first))
    if entry.expected_artifact_sha256 and entry.expected_artifact_sha256 != manifest["artifact_sha256"]:
        return bad("E_ADAPTER_DIGEST_MISMATCH", f"adapter {entry.id!r} at {entry.path} has artifact_sha256 "
                   f"{manifest['artifact_sha256']}, the catalog expects {entry.expected_artifact_sha256}: "
                   "the directory holds another adapter; fix the path or the expected digest")
    unservable = next((f for f in found if f.severity == UNSERVABLE), None)
    if unservable is not None:
        return bad(unservable.code, _where(unservable))
    modules = []
    for rec in sorted(art.modules, key=lambda m: m.name):
        problem = unsupported_module(rec.name, rec.kind, rec.role, rec.layer)
        if problem:
            return bad("E_ADAPTER_MODULE_UNSUPPORTED", f"adapter {entry.id!r}: {problem}")
        modules.append(PinnedModule(
            name=rec.name, layer=rec.layer, role=rec.role, rank=rec.rank, scale=float(rec.scale),
            d_in=rec.d_in, d_out=rec.d_out, a=_ref(art, rec.a, rec.a_sha256), b=_ref(art, rec.b, rec.b_sha256),
        ))
    return PinnedAdapter(
        id=entry.id, path=entry.path, ok=True, artifact_sha256=manifest["artifact_sha256"],
        semantic_sha256=manifest["semantic_sha256"], max_rank=max(m.rank for m in modules),
        modules=tuple(modules), findings=found, invocation_tokens=_invocation_tokens(manifest["activation_policy"]),
    )


def _invocation_tokens(policy: dict) -> tuple[int, ...] | None:
    """An aLoRA adapter's invocation token ids (docs/identity.md, Activation policy); None: always on."""
    return tuple(policy["invocation_tokens"]) if policy["kind"] == "alora" else None


def _where(f: Finding) -> str:
    return f"{f.module}: {f.message}" if f.module else f.message


def _ref(art: AdapterArtifact, t, sha256: str | None) -> TensorRef:
    if sha256 is None:  # pin() scanned every tensor it pins
        raise AssertionError(f"tensor {t.name!r} was not scanned")
    if isinstance(t, MemTensor):  # read from the adapter's pickle, which load_factors reads again
        return TensorRef(t.name, os.path.join(art.path, PICKLE_FILE), 0, t.nbytes, t.dtype, tuple(t.shape), sha256,
                         pickled=True)
    assert isinstance(t, TensorInfo)
    return TensorRef(t.name, t.path, t.offset, t.nbytes, t.dtype, tuple(t.shape), sha256)


# ---- verified loading ------------------------------------------------------------


def load_factors(pinned: PinnedAdapter, dtype: torch.dtype, device) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]:
    """(layer, role) -> (A [r, d_in], B [d_out, r], scale) of a pinned adapter,
    in ``dtype`` on ``device``. Every tensor's bytes are re-hashed with the
    tensor digest of docs/identity.md and must equal the pinned digest, else
    :class:`AdapterChanged`. A module outside ``ROLE_SLICE`` raises
    AdapterError (E_ADAPTER_MODULE_UNSUPPORTED) rather than being skipped."""
    if not pinned.ok:
        raise AdapterError(pinned.error_code or "E_ADAPTER_INVALID", pinned.error_message or "not servable", pinned.id)
    if pinned.bundle is not None:
            return member_factors(pinned, dtype, device)
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]] = {}
    files: dict[str, int] = {}
    pickles: dict[str, dict[str, MemTensor]] = {}
    try:
        for m in pinned.modules:
            problem = unsupported_module(m.name, "linear", m.role, m.layer)
            if problem:
                raise AdapterError("E_ADAPTER_MODULE_UNSUPPORTED", f"adapter {pinned.id!r}: {problem}", pinned.id)
            a, b = (_read_verified(pinned.id, ref, files, pickles) for ref in (m.a, m.b))
            out[(m.layer, m.role)] = (a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype), m.scale)
    finally:
        for fd in files.values():
            os.close(fd)
    return out


def _read_verified(adapter_id: str, ref: TensorRef, files: dict[str, int],
                   pickles: dict[str, dict[str, MemTensor]]) -> torch.Tensor:
    try:
        if ref.pickled:
            data = read_verified(_pickled(adapter_id, ref, pickles), ref.sha256)
        else:
            if ref.path not in files:
                files[ref.path] = os.open(ref.path, os.O_RDONLY)
            data = read_verified(ref, ref.sha256, files[ref.path])
    except OSError as exc:
        raise AdapterChanged(adapter_id, f"{ref.path} cannot be read ({exc})") from None
    except TensorChanged as exc:
        raise AdapterChanged(adapter_id, f"tensor {ref.name!r} ends early in {ref.path}" if exc.short
                             else f"tensor {ref.name!r} no longer hashes to its pinned digest") from None
    if ref.dtype not in _TORCH_DTYPES:
        raise AdapterError("E_UNSUPPORTED_DTYPE", f"tensor {ref.name!r} is {ref.dtype}", adapter_id)
    return torch.frombuffer(data, dtype=_TORCH_DTYPES[ref.dtype]).reshape(ref.shape)


def _pickled(adapter_id: str, ref: TensorRef, pickles: dict[str, dict[str, MemTensor]]) -> MemTensor:
    """Tensor ``ref.name`` of the pickle at ``ref.path``, loaded once per :func:`load_factors` call."""
    if ref.path not in pickles:
        try:
            pickles[ref.path] = load_pickle_tensors(ref.path)
        except Exception as exc:  # torch.load raises many types; all mean "no longer readable"
            raise AdapterChanged(adapter_id, f"{ref.path} cannot be read ({type(exc).__name__}: {exc})") from None
    t = pickles[ref.path].get(ref.name)
    if t is None:
        raise AdapterChanged(adapter_id, f"tensor {ref.name!r} is no longer in {ref.path}")
    return t
