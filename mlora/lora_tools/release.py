"""Immutable merged releases: ``mlora merge``, ``mlora unmerge``, ``mlora release verify``.

Owns the release format and the three operations on it (docs/design.md,
Release). Merging creates a new base revision; arithmetic unmerge is a
convenience that never claims to be an exact rollback (the clean base is the
rollback source).

**Merge.** ``W' = W + sum_k w_k * s_k * B_k A_k`` in the given adapter order,
computed in ``compute_dtype`` (float32) from the base tensor, rounded once to
the output dtype (``auto``: the base tensor's own). Streaming: tensors are
read one at a time from the base's safetensors files and written straight
into the output files through a streaming safetensors writer, so peak memory
is about the largest tensor plus the adapters' factors, never the model.
Every adapter is validated against the base as ``mlora validate`` does; refused with
``E_MERGE_UNSUPPORTED`` (naming the finding): invalid adapters, DoRA,
lora_bias, trained biases and every other unservable variant; aLoRA with
``E_MERGE_ALORA`` (servable, but its activation depends on the prompt:
docs/identity.md, Activation policy);
LoRA on a tied ``lm_head`` (``E_MERGE_TIED``: merging would change the
input embedding too); an adapter that declares another base
(``E_MERGE_BASE_MISMATCH``, naming validate's ``W_BASE_NAME_MISMATCH``) unless
``allow_base_mismatch``, which records it in ``warnings``. ``safe``: a non-finite
merged value anywhere stops the merge and nothing is written (PEFT's
``safe_merge``, whole model); without it, each tensor holding one is a
``W_MERGE_NONFINITE`` warning.

**Release directory** (written into a hidden temporary sibling, renamed into
place; an existing path is never overwritten; files read-only): the base's
file layout (same shard names and index; tokenizer, generation and other
files copied; ``config.json`` with the output dtype) plus ``release.json``::

    schema_version, kind ("merge" | "arithmetic-unmerge"), parent (base identity,
    or the parent release's digest), adapters (ordered: id, path, weight,
    artifact/semantic digests), dtypes (compute, output), files {name: bytes},
    file_sha256 {name: sha256} (every file that is not a weight shard),
    tensors {name: {file, dtype, shape, sha256}}, changed (merged tensor names),
    warnings [{code, adapter | tensor, message}] (present only when not empty),
    release_sha256 (sha256 of the document form of all the rest: mlora.lora_tools.canonical)

Tensor digests are the same as adapters' (canonical dtype/shape prefix +
bytes). ``verify`` re-hashes everything: a flipped byte, a truncated or
removed file, a file added beside them (a loader could read it: an extra
weight file and index would replace the merged weights) or an edited
release.json are caught (``E_RELEASE_TAMPERED``,
``E_RELEASE_TRUNCATED``, ``E_RELEASE_MISSING``), and with a base, the parent
identity is checked (``E_RELEASE_PARENT``).
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from mlora.lora_tools.adapter import check_against_base, open_adapter, scan_adapters
from mlora.lora_tools.atomic import atomic_directory, check_new
from mlora.lora_tools.base import (
    INDEX_FILE,
    RELEASE_FILE,
    BaseCheckpoint,
    BaseCheckpointError,
    release_record,
    unlisted_files,
)
from mlora.lora_tools.canonical import file_sha256, sealed_digest
from mlora.lora_tools.manifest import build_manifest
from mlora.lora_tools.safetensors_io import (
    SafetensorsError,
    TensorChanged,
    TensorInfo,
    read_header,
    read_tensor_bytes,
    read_verified,
    tensor_sha256,
)

BASE_MISMATCH = "W_BASE_NAME_MISMATCH"  # the finding of validate --base (mlora.lora_tools.adapter)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ST = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
      "BOOL": torch.bool}
ST_NAME = {v: k for k, v in ST.items()}


class ReleaseError(ValueError):
    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


@dataclass
class MergeAdapter:
    path: str
    weight: float = 1.0


# ---------------------------------------------------------------- bytes and digests


def _read(info: TensorInfo) -> torch.Tensor:
    """One tensor read straight into its own buffer (one copy from the page cache)."""
    data = read_tensor_bytes(info)
    if len(data) != info.nbytes:
        raise ReleaseError("E_RELEASE_TRUNCATED", f"{info.path}: tensor bytes end early")
    buf = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return buf.view(ST[info.dtype]).reshape(tuple(info.shape))


class StreamingSafetensors:
    """Writes one safetensors file tensor by tensor: the header (all names, dtypes,
    shapes, offsets) first, then each tensor's bytes in name order. A written
    tensor is hashed on a helper thread while the caller prepares the next one
    (at most one in flight); a tensor copied unchanged from another file moves
    kernel-side (``copy_file_range``) with its known digest. ``digests`` after close."""

    def __init__(self, path: str, specs: dict[str, tuple[str, tuple[int, ...]]]):
        self.path, self.order = path, sorted(specs)
        header, at = {}, 0
        for name in self.order:
            dtype, shape = specs[name]
            size = torch.empty((), dtype=ST[dtype]).element_size()
            for d in shape:
                size *= d
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + size]}
            at += size
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.specs = specs
        self.sizes = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
        self.f = open(path, "wb")
        self.f.write(len(raw).to_bytes(8, "little") + raw)
        self.next = 0
        self.digests: dict[str, str] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlora-release-hash")
        self._pending = None

    def _advance(self, name: str) -> tuple[str, tuple[int, ...]]:
        if name != self.order[self.next]:
            raise AssertionError(f"tensors must be written in name order: expected {self.order[self.next]}, got {name}")
        self.next += 1
        return self.specs[name]

    def _settle(self) -> None:
        if self._pending is not None:
            name, fut = self._pending
            self.digests[name] = fut.result()
            self._pending = None

    def write(self, name: str, t: torch.Tensor) -> None:
        dtype, shape = self._advance(name)
        if tuple(t.shape) != tuple(shape) or ST_NAME[t.dtype] != dtype:
            raise AssertionError(f"{name}: {tuple(t.shape)} {t.dtype} does not match its header")
        t = t.detach().to("cpu").contiguous()
        view = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        self.f.write(view)
        self._settle()  # the previous tensor's digest; then this one's on the helper thread

        def digest(view=view, keep=t):
            return tensor_sha256(dtype, shape, view)

        self._pending = (name, self._pool.submit(digest))

    def copy(self, name: str, src: str, offset: int, nbytes: int, sha256: str) -> None:
        """Append ``nbytes`` of ``src`` at ``offset`` unchanged (its digest is known)."""
        self._advance(name)
        if nbytes != self.sizes[name]:
            raise AssertionError(f"{name}: {nbytes} bytes to copy, the header holds {self.sizes[name]}")
        self.f.flush()
        with open(src, "rb") as fin:
            done = 0
            while done < nbytes:
                try:
                    n = os.copy_file_range(fin.fileno(), self.f.fileno(), nbytes - done, offset + done)
                except (AttributeError, OSError):
                    n = 0
                if n <= 0:  # no kernel-side copy here: read and write
                    data = os.pread(fin.fileno(), nbytes - done, offset + done)
                    if not data:
                        raise ReleaseError("E_RELEASE_TRUNCATED", f"{src}: tensor {name!r} ends early")
                    os.write(self.f.fileno(), data)
                    n = len(data)
                done += n
        self.f.seek(0, os.SEEK_END)
        self.digests[name] = sha256

    def close(self) -> None:
        try:
            self._settle()
        finally:
            self._pool.shutdown(wait=True)
            self.f.close()


# ---------------------------------------------------------------- adapters


def _load_adapters(base: BaseCheckpoint, adapters: list[MergeAdapter], workers=None, allow_base_mismatch=False):
    """Validated adapters: [(MergeAdapter, manifest, {module: (A, B, scale)})]. An adapter that declares
    another base (``validate --base``'s W_BASE_NAME_MISMATCH) is refused unless ``allow_base_mismatch``."""
    arts = [open_adapter(a.path) for a in adapters]
    scan_adapters(arts, workers)
    for art in arts:
        check_against_base(art, base)
    identity = base.identity(workers)
    out = []
    for a, art in zip(adapters, arts):
        man = build_manifest(art, identity)
        bad = next((f for f in art.findings if f.severity in ("error", "unservable")), None)
        if bad is not None or not man["valid"]:
            why = f"{bad.code}: {bad.message}" if bad else "not a valid adapter"
            raise ReleaseError("E_MERGE_UNSUPPORTED", f"adapter {art.name!r} cannot be merged by mlora ({why})")
        if man["activation_policy"]["kind"] == "alora":
            tokens = man["activation_policy"]["invocation_tokens"]
            raise ReleaseError("E_MERGE_ALORA", f"adapter {art.name!r} is an activated LoRA (alora_invocation_tokens "
                               f"{tokens}): it applies from its invocation in each prompt on, which no merged weight "
                               "can express; serve it with `mlora batch-run`, which activates it per token")
        other = next((f for f in art.findings if f.code == BASE_MISMATCH), None)
        if other is not None and not allow_base_mismatch:
            raise ReleaseError("E_MERGE_BASE_MISMATCH", f"adapter {art.name!r} declares another base than "
                               f"{base.name!r} ({other.code}: {other.message}); merge it into the base it was "
                               "trained on, or pass --allow-base-mismatch if this is that base")
        factors = {}
        for rec in art.modules:
            if rec.kind != "linear":
                raise ReleaseError("E_MERGE_UNSUPPORTED", f"adapter {art.name!r}: {rec.name} is not a linear module")
            if rec.name + ".weight" not in base.tensors:
                raise ReleaseError("E_MERGE_TIED", f"adapter {art.name!r} adapts {rec.name}, whose weight is tied to "
                                   "another tensor in the base (not stored): merging would change both; untie it or "
                                   "serve the adapter live")
            factors[rec.name] = (_factor(rec.a, rec.a_sha256, art.name), _factor(rec.b, rec.b_sha256, art.name),
                                 float(rec.scale))
        out.append((a, art, man, factors))
    return out, identity


def _factor(t, digest: str | None, name: str) -> torch.Tensor:
    try:
        data = read_verified(t, digest)
    except TensorChanged:
        raise ReleaseError("E_MERGE_ADAPTER_CHANGED", f"adapter {name!r}: {t.name} changed since it was validated"
                           ) from None
    return torch.frombuffer(data, dtype=ST[t.dtype]).reshape(tuple(t.shape))


# ---------------------------------------------------------------- writing a release


def _write_release(src_dir: str, out: str, tensors: dict, produce, out_dtype_of, manifest: dict, config_dtype: str | None,
                   safe: bool, progress=None) -> dict:
    """The common writer of merge and unmerge: every tensor of ``tensors`` (name -> TensorInfo-like)
    produced by ``produce(name)``, in the source's file layout, plus copied side files. A produced
    tensor with a non-finite value stops the write (``safe``) or adds a warning to ``manifest["warnings"]``."""
    warnings = list(manifest.get("warnings", []))
    with atomic_directory(out, _release_exists) as tmp:
        files: dict[str, list[str]] = {}
        for name, info in tensors.items():
            files.setdefault(os.path.basename(info.path), []).append(name)
        records = {}
        for file, names in sorted(files.items()):
            specs = {n: (out_dtype_of(n), tuple(tensors[n].shape)) for n in names}
            w = StreamingSafetensors(os.path.join(tmp, file), specs)
            try:
                for n in w.order:
                    if progress:
                        progress(n, tensors[n].nbytes)
                    t = produce(n)
                    if isinstance(t, tuple):  # ("copy", path, offset, nbytes, sha256): unchanged bytes
                        w.copy(n, *t[1:])
                        continue
                    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        if safe:
                            raise ReleaseError("E_MERGE_NONFINITE", f"{n}: the merged weights are not finite in "
                                               f"{specs[n][0]} (--safe); nothing was written")
                        warnings.append(_nonfinite_warning(n, t, specs[n][0]))
                    w.write(n, t)
            finally:
                w.close()
            for n in names:
                records[n] = {"file": file, "dtype": specs[n][0], "shape": list(specs[n][1]), "sha256": w.digests[n]}
        if len(files) > 1 or os.path.exists(os.path.join(src_dir, INDEX_FILE)):
            index = {"metadata": {"total_size": sum(os.path.getsize(os.path.join(tmp, f)) for f in files)},
                     "weight_map": {n: r["file"] for n, r in sorted(records.items())}}
            with open(os.path.join(tmp, INDEX_FILE), "w") as f:
                json.dump(index, f, indent=2)
        for entry in sorted(os.listdir(src_dir)):
            full = os.path.join(src_dir, entry)
            if (entry in files or entry in (RELEASE_FILE, INDEX_FILE) or entry.startswith(".")
                    or not os.path.isfile(full)):
                continue
            shutil.copyfile(full, os.path.join(tmp, entry))
        if config_dtype is not None and os.path.exists(os.path.join(tmp, "config.json")):
            with open(os.path.join(tmp, "config.json")) as f:
                cfg = json.load(f)
            for key in ("torch_dtype", "dtype"):
                if key in cfg or key == "dtype":
                    cfg[key] = config_dtype
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(cfg, f, indent=2)
        side = {}  # every file that is not a weight shard: hashed whole (tokenizer, configs, index)
        for f in sorted(os.listdir(tmp)):
            if f not in files:
                side[f] = file_sha256(os.path.join(tmp, f))
        manifest = dict(manifest, schema_version=1, tensors=records, file_sha256=side,
                        files={f: os.path.getsize(os.path.join(tmp, f)) for f in sorted(os.listdir(tmp))})
        manifest.pop("warnings", None)
        if warnings:  # absent when empty: a clean release's document (and digest) has no warnings key
            manifest["warnings"] = warnings
        manifest["release_sha256"] = sealed_digest(manifest, "release_sha256")
        with open(os.path.join(tmp, RELEASE_FILE), "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.write("\n")
    return manifest


def _nonfinite_warning(name: str, t: torch.Tensor, dtype: str) -> dict:
    count = int((~torch.isfinite(t)).sum())
    return {"code": "W_MERGE_NONFINITE", "tensor": name, "count": count,
            "message": f"{name}: {count} merged value(s) are not finite in {dtype} (overflow); the release holds "
                       "them as computed: lower the adapter weight or use a wider --dtype, and pass --safe to refuse "
                       "such a merge"}


CHUNK_ELEMENTS = 1 << 20  # rows of a weight merged together: about 4 MiB of float32, cache-sized


def _merged(t: torch.Tensor, deltas: list, cdt: torch.dtype, target: torch.dtype, sign: float = 1.0) -> torch.Tensor:
    """``t + sign * sum_k coef_k * B_k A_k`` computed in ``cdt`` and rounded once to ``target``,
    a block of rows at a time (the float32 copy of a block stays in cache)."""
    out = torch.empty(t.shape, dtype=target)
    factors = [(sign * coef, B.to(cdt), A.to(cdt)) for coef, A, B in deltas]
    rows = max(1, CHUNK_ELEMENTS // max(t.shape[1], 1))
    for r0 in range(0, t.shape[0], rows):
        w = t[r0 : r0 + rows].to(cdt, copy=True)  # never modify t in place
        for coef, B, A in factors:
            w.addmm_(B[r0 : r0 + rows], A, alpha=coef)
        out[r0 : r0 + rows] = w
    return out


def _release_exists(path: str, during: bool) -> ReleaseError:
    return ReleaseError("E_RELEASE_EXISTS", f"{path} {'appeared while writing' if during else 'exists'}; "
                        "releases are immutable: choose a new path")


def merge(base_dir: str, adapters: list[MergeAdapter], out: str, *, dtype: str = "auto",
          compute_dtype: str = "float32", safe: bool = False, allow_base_mismatch: bool = False,
          workers: int | None = None, progress=None) -> dict:
    """Merge ``adapters`` (in order) into the base at ``base_dir``; write the release ``out``; return release.json.
    ``progress(tensor_name, nbytes)`` is called before each tensor is written. ``allow_base_mismatch``: merge
    an adapter that declares another base (recorded as a warning) instead of refusing it."""
    if not adapters:
        raise ReleaseError("E_MERGE_USAGE", "name at least one --adapter")
    if dtype != "auto" and dtype not in DTYPES:
        raise ReleaseError("E_MERGE_USAGE", f"--dtype must be auto or one of {', '.join(DTYPES)}")
    if compute_dtype not in ("float32", "float64"):
        raise ReleaseError("E_MERGE_USAGE", "--compute-dtype must be float32 or float64")
    check_new(out, _release_exists)
    try:
        base = BaseCheckpoint(base_dir)
    except BaseCheckpointError as exc:
        raise ReleaseError("E_BASE_INVALID", str(exc)) from None
    loaded, identity = _load_adapters(base, adapters, workers, allow_base_mismatch)
    cdt = torch.float64 if compute_dtype == "float64" else torch.float32
    deltas: dict[str, list] = {}
    for a, art, man, factors in loaded:
        for module, (A, B, s) in factors.items():
            deltas.setdefault(module + ".weight", []).append((a.weight * s, A, B))

    def out_dtype_of(name: str) -> str:
        info = base.tensors[name]
        if dtype == "auto" or ST[info.dtype] not in (torch.float32, torch.float16, torch.bfloat16):
            return info.dtype
        return ST_NAME[DTYPES[dtype]]

    known = getattr(base, "tensor_digests", {})

    def produce(name: str):
        info = base.tensors[name]
        target = ST[out_dtype_of(name)]
        if name not in deltas and ST[info.dtype] == target and name in known:
            return ("copy", info.path, info.offset, info.nbytes, known[name])  # unchanged: no decode, no re-hash
        t = _read(info)
        if name not in deltas:
            return t.to(target)
        return _merged(t, deltas[name], cdt, target)

    manifest = {
        "kind": "merge",
        "parent": {"kind": "base", **identity.to_json()},
        "adapters": [{"id": art.name, "path": os.path.abspath(a.path), "weight": a.weight,
                      "artifact_sha256": man["artifact_sha256"], "semantic_sha256": man["semantic_sha256"]}
                     for a, art, man, _ in loaded],
        "dtypes": {"compute": compute_dtype, "output": dtype},
        "changed": sorted(deltas),
        "warnings": [{"code": f.code, "adapter": art.name, "message": f.message}
                     for _, art, _, _ in loaded for f in art.findings if f.code == BASE_MISMATCH],
    }
    return _write_release(base_dir, out, base.tensors, produce, out_dtype_of, manifest,
                          None if dtype == "auto" else dtype, safe, progress)


# ---------------------------------------------------------------- verify


def read_release(path: str) -> dict:
    """release.json, its own digest checked."""
    try:
        man = release_record(path)
    except BaseCheckpointError as exc:
        raise ReleaseError("E_RELEASE_TAMPERED", str(exc)) from None
    if man is None:
        raise ReleaseError("E_RELEASE_MISSING", f"{path} has no {RELEASE_FILE}: not an mlora release")
    return man


def verify(path: str, base_dir: str | None = None, workers: int | None = None) -> dict:
    """Re-hash every tensor of the release against release.json; with ``base_dir``, check
    the parent identity (merge releases). Raises ReleaseError on the first problem."""
    man = read_release(path)
    extra = unlisted_files(path, man)
    if extra:
        raise ReleaseError("E_RELEASE_TAMPERED", f"{path} holds files {RELEASE_FILE} does not list: "
                           f"{', '.join(extra)}; a loader could read them: remove them or restore the release")
    for file, size in man["files"].items():
        full = os.path.join(path, file)
        if file == RELEASE_FILE:
            continue
        if not os.path.exists(full):
            raise ReleaseError("E_RELEASE_MISSING", f"{file} is missing from {path}")
        if os.path.getsize(full) != size:
            code = "E_RELEASE_TRUNCATED" if os.path.getsize(full) < size else "E_RELEASE_TAMPERED"
            raise ReleaseError(code, f"{file} is {os.path.getsize(full)} bytes, release.json says {size}")
    for file, digest in man.get("file_sha256", {}).items():
        if file_sha256(os.path.join(path, file)) != digest:
            raise ReleaseError("E_RELEASE_TAMPERED", f"{file} does not match its digest in release.json")
    headers = {}
    for name, rec in sorted(man["tensors"].items()):
        file = os.path.join(path, rec["file"])
        if file not in headers:
            try:
                headers[file] = read_header(file)
            except SafetensorsError as exc:
                raise ReleaseError("E_RELEASE_TRUNCATED" if "TRUNCATED" in exc.code else "E_RELEASE_TAMPERED",
                                   f"{rec['file']}: {exc}") from None
        info = headers[file].tensors.get(name)
        if info is None:
            raise ReleaseError("E_RELEASE_TAMPERED", f"{rec['file']} lacks tensor {name!r}")
        try:
            read_verified(info, rec["sha256"])
        except TensorChanged:
            raise ReleaseError("E_RELEASE_TAMPERED", f"tensor {name!r} in {rec['file']} does not match its digest"
                               ) from None
    extra = sorted(set(sum((list(h.tensors) for h in headers.values()), [])) - set(man["tensors"]))
    if extra:
        raise ReleaseError("E_RELEASE_TAMPERED", f"tensors not named by release.json: {extra[:5]}")
    result = {"release": path, "release_sha256": man["release_sha256"], "kind": man["kind"],
              "tensors": len(man["tensors"]), "ok": True}
    if base_dir is not None and man["parent"].get("kind") == "base":
        measured = BaseCheckpoint(base_dir).identity(workers).base_sha256
        if measured != man["parent"]["base_sha256"]:
            raise ReleaseError("E_RELEASE_PARENT", f"the release was merged into base {man['parent']['base_sha256']}, "
                               f"{base_dir} is {measured}")
        result["parent_checked"] = True
    return result


# ---------------------------------------------------------------- unmerge


def _ordered_ints(t: torch.Tensor) -> torch.Tensor:
    """Float bits mapped to integers whose order is the floats' order (for ULP distances)."""
    bits = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
            torch.float64: torch.int64}[t.dtype]
    i = t.contiguous().view(bits).to(torch.int64)
    lo = torch.iinfo(bits).min
    return torch.where(i < 0, lo - i, i)


def unmerge(release_dir: str, out: str, adapter_ids: list[str] | None = None, base_dir: str | None = None,
            compute_dtype: str = "float32") -> tuple[dict, dict | None]:
    """Subtract the named adapters (default: all) of a merge release, in reverse merge order,
    into a new release of kind ``arithmetic-unmerge``. With ``base_dir``, also returns the
    drift against the clean base. Never an exact rollback: the clean base is."""
    man = verify(release_dir)
    if man["kind"] != "merge":
        raise ReleaseError("E_UNMERGE_KIND", f"{release_dir} is an {man['kind']} release; unmerge a merge release")
    rel = read_release(release_dir)
    merged = rel["adapters"]
    ids = [a["id"] for a in merged] if not adapter_ids else list(adapter_ids)
    unknown = [i for i in ids if i not in [a["id"] for a in merged]]
    if unknown:
        raise ReleaseError("E_UNMERGE_ADAPTER", f"{unknown} were not merged into {release_dir}; it holds "
                           f"{[a['id'] for a in merged]}")
    try:
        source = BaseCheckpoint(release_dir)
    except BaseCheckpointError as exc:
        raise ReleaseError("E_RELEASE_TAMPERED", str(exc)) from None
    removing = [a for a in reversed(merged) if a["id"] in ids]
    # the adapters name the clean base, not this release: their digests are checked below instead
    loaded, _ = _load_adapters(source, [MergeAdapter(a["path"], a["weight"]) for a in removing],
                               allow_base_mismatch=True)
    for (ma, art, m, _f), rec in zip(loaded, removing):
        if m["artifact_sha256"] != rec["artifact_sha256"]:
            raise ReleaseError("E_UNMERGE_ADAPTER_CHANGED", f"adapter {rec['id']!r} at {rec['path']} is not the "
                               "adapter that was merged (artifact digest differs)")
    cdt = torch.float64 if compute_dtype == "float64" else torch.float32
    deltas: dict[str, list] = {}
    for a, art, _m, factors in loaded:
        for module, (A, B, s) in factors.items():
            deltas.setdefault(module + ".weight", []).append((a.weight * s, A, B))

    def produce(name: str) -> torch.Tensor:
        info = source.tensors[name]
        t = _read(info)
        if name not in deltas:
            return t
        return _merged(t, deltas[name], cdt, t.dtype, sign=-1.0)  # deltas are in reverse merge order

    manifest = {
        "kind": "arithmetic-unmerge",
        "parent": {"kind": "release", "release_sha256": rel["release_sha256"],
                   "base_sha256": rel["parent"].get("base_sha256")},
        "adapters": [dict(a, removed=True) for a in removing],
        "dtypes": {"compute": compute_dtype, "output": "auto"},
        "changed": sorted(deltas),
        "exact_rollback": "the clean base; arithmetic unmerge is not exact",
    }
    new = _write_release(release_dir, out, source.tensors, produce, lambda n: source.tensors[n].dtype, manifest,
                         None, False)
    drift = None
    if base_dir is not None:
        drift = drift_report(out, base_dir)
    return new, drift


def drift_report(release_dir: str, base_dir: str) -> dict:
    """Tensors and elements of the release that differ from the clean base, max abs, max ULP."""
    rel, base = BaseCheckpoint(release_dir), BaseCheckpoint(base_dir)
    tensors = elements = 0
    max_abs, max_ulp = 0.0, 0
    for name, info in sorted(base.tensors.items()):
        other = rel.tensors.get(name)
        if other is None:
            raise ReleaseError("E_RELEASE_PARENT", f"{name} is in the base but not in {release_dir}")
        a = _read(info)
        b = _read(other)
        if a.dtype != b.dtype or a.shape != b.shape:
            raise ReleaseError("E_RELEASE_PARENT", f"{name}: {a.dtype} {tuple(a.shape)} in the base, "
                               f"{b.dtype} {tuple(b.shape)} in the release")
        diff = a != b
        n = int(diff.sum())
        if n:
            tensors += 1
            elements += n
            if a.is_floating_point():
                max_abs = max(max_abs, float((a.double() - b.double()).abs().max()))
                max_ulp = max(max_ulp, int((_ordered_ints(a) - _ordered_ints(b)).abs().max()))
    return {"tensors_differing": tensors, "elements_differing": elements, "max_abs": max_abs, "max_ulp": max_ulp,
            "exact": tensors == 0, "note": "exact rollback is the clean base; this measured the arithmetic unmerge"}
