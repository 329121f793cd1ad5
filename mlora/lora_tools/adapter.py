"""PEFT LoRA adapter artifacts: lazy reading, module records, structural checks.

Owns an adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``,
or ``adapter_model.bin`` only with ``allow_pickle``): the mapping from stored
tensor keys to canonical base-module names, the per-module record
(docs/identity.md, Module record: rank, alpha, scale, shapes, factor digests) and every finding that can
be made from the artifact alone or against a base. Tensor bytes are read only
by :func:`scan_adapters`, which streams and hashes them on all cores.

Key layout written by PEFT ``save_pretrained`` (adapter name stripped)::

    base_model.model.<module>.lora_A.weight      [r, d_in]     logical A
    base_model.model.<module>.lora_B.weight      [d_out, r]    logical B
    base_model.model.<module>.lora_embedding_A   [r, num_embeddings]
    base_model.model.<module>.lora_embedding_B   [embedding_dim, r]
    ...lora_magnitude_vector (DoRA), ...lora_B.bias (lora_bias),
    <module>.bias (bias != none), <module>.weight (modules_to_save),
    <module>.base_layer.weight (saved embedding layers), trainable tokens.

The canonical module name is the key minus ``base_model.model.``: the module's
path inside the Hugging Face model, the same name PEFT matches patterns on.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field

from mlora.lora_tools.findings import Finding, finding
from mlora.lora_tools.peft_config import LoraSpec, layer_index, module_is_targeted, parse_lora_config, pattern_key
from mlora.lora_tools.safetensors_io import (
    SafetensorsError,
    TensorInfo,
    TensorScan,
    numel,
    read_header,
    scan_bytes,
    scan_many,
)

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
PEFT_PREFIX = "base_model.model."
FACTOR_DTYPES = ("F32", "F16", "BF16")

_FACTOR_RE = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)\.weight$")
_EMBED_RE = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_embedding_A|lora_embedding_B)$")


@dataclass
class MemTensor:
    """A tensor already in memory (read from a pickle): same fields as TensorInfo."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)

    @property
    def numel(self) -> int:
        return numel(self.shape)


Tensor = TensorInfo | MemTensor


@dataclass
class ModuleRecord:
    """One adapted base module (its ``module_spec``: docs/identity.md, Module record)."""

    name: str
    kind: str  # "linear" or "embedding"
    a: Tensor
    b: Tensor
    rank: int
    alpha: float | int
    scale: float
    scale_rule: str
    a_sha256: str | None = None
    b_sha256: str | None = None

    @property
    def role(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @property
    def layer(self) -> int | None:
        return layer_index(self.name)

    @property
    def d_in(self) -> int:
        return self.a.shape[1]

    @property
    def d_out(self) -> int:
        return self.b.shape[0]

    @property
    def dtype(self) -> str:
        return self.a.dtype

    @property
    def parameters(self) -> int:
        return self.a.numel + self.b.numel


@dataclass
class AdapterArtifact:
    """An adapter directory as read so far. ``spec`` is None when the config
    could not be interpreted; ``modules`` holds only well-formed factor pairs."""

    path: str
    name: str
    format: str | None = None  # "safetensors" | "pickle"
    spec: LoraSpec | None = None
    tensors: dict[str, Tensor] = field(default_factory=dict)
    modules: list[ModuleRecord] = field(default_factory=list)
    extra: dict[str, Tensor] = field(default_factory=dict)  # non-factor tensors, bound into identity
    extra_sha256: dict[str, str] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    scanned: bool = False

    @property
    def has_errors(self) -> bool:
        return any(f.severity == "error" for f in self.findings)

    def add(self, f: Finding) -> None:
        self.findings.append(f)


def discover_adapters(path: str) -> list[str] | None:
    """Adapter directories named by ``path``: itself when it holds an adapter,
    else its immediate sub-directories that look like adapters (sorted).
    None when ``path`` is neither."""
    if _looks_like_adapter(path):
        return [path]
    if not os.path.isdir(path):
        return None
    subs = sorted(
        os.path.join(path, d)
        for d in os.listdir(path)
        if not d.startswith(".") and _looks_like_adapter(os.path.join(path, d))
    )
    return subs or None


def _looks_like_adapter(path: str) -> bool:
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, f)) for f in (CONFIG_FILE, SAFETENSORS_FILE, PICKLE_FILE)
    )


def open_adapter(path: str, allow_pickle: bool = False) -> AdapterArtifact:
    """Read config and tensor headers of one adapter directory; build module
    records and every finding that needs no tensor values."""
    art = AdapterArtifact(path=path, name=os.path.basename(os.path.normpath(path)))
    _read_config(art)
    if _read_tensor_table(art, allow_pickle) and art.spec is not None:
        _build_modules(art)
    return art


def _read_config(art: AdapterArtifact) -> None:
    cfg = os.path.join(art.path, CONFIG_FILE)
    if not os.path.isfile(cfg):
        art.add(finding("E_CONFIG_MISSING", f"no {CONFIG_FILE} in {art.path}"))
        return
    try:
        with open(cfg, "rb") as f:
            raw = json.loads(f.read(16 * 1024 * 1024).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        art.add(finding("E_CONFIG_PARSE", f"{CONFIG_FILE} is not valid JSON ({exc})"))
        return
    art.spec, found = parse_lora_config(raw)
    art.findings.extend(found)
    if art.spec is not None:
        art.findings.extend(art.spec.unservable_findings())
        art.findings.extend(art.spec.info_findings())


def _read_tensor_table(art: AdapterArtifact, allow_pickle: bool) -> bool:
    """Fill ``art.tensors`` from the weights file; False when it could not be read."""
    st = os.path.join(art.path, SAFETENSORS_FILE)
    pk = os.path.join(art.path, PICKLE_FILE)
    if os.path.isfile(st):
        art.format = "safetensors"
        try:
            art.tensors = dict(read_header(st).tensors)
        except SafetensorsError as exc:
            art.add(finding(exc.code, f"{SAFETENSORS_FILE}: {exc}"))
            return False
    elif os.path.isfile(pk):
        art.format = "pickle"
        if not allow_pickle:
            art.add(finding("E_PICKLE_REFUSED", f"{PICKLE_FILE} is a pickle, which can run code when loaded"))
            return False
        try:
            art.tensors = load_pickle_tensors(pk)
        except Exception as exc:  # torch.load raises many types; all mean "unreadable"
            art.add(finding("E_PICKLE_LOAD", f"{PICKLE_FILE}: {type(exc).__name__}: {exc}"))
            return False
    else:
        art.add(finding("E_WEIGHTS_MISSING", f"no {SAFETENSORS_FILE} in {art.path}"))
        return False
    return True


def load_pickle_tensors(path: str) -> dict[str, MemTensor]:
    """The floating-point tensors of a PEFT ``adapter_model.bin``, read with
    ``torch.load(weights_only=True)`` (``--allow-pickle``); raises on anything else."""
    import torch  # only the pickle path needs torch

    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise TypeError("the pickle does not hold a state dict")
    out: dict[str, MemTensor] = {}
    for key, t in state.items():
        if not isinstance(t, torch.Tensor) or t.dtype not in names:
            raise TypeError(f"entry {key!r} is not a floating-point tensor")
        data = t.detach().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out[key] = MemTensor(key, names[t.dtype], tuple(t.shape), data)
    return out


def _canonical(key: str) -> str:
    return key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key


def _build_modules(art: AdapterArtifact) -> None:
    spec = art.spec
    assert spec is not None
    pairs: dict[tuple[str, str], dict[str, Tensor]] = {}
    for key, t in art.tensors.items():
        m = _FACTOR_RE.match(key) or _EMBED_RE.match(key)
        if m:
            kind = "embedding" if m.group("kind").startswith("lora_embedding") else "linear"
            side = m.group("kind")[-1]
            pairs.setdefault((_canonical(m.group("module")), kind), {})[side] = t
        elif _explained_extra(spec, _canonical(key), art.tensors):
            art.extra[key] = t
        else:
            art.add(finding("E_UNEXPECTED_KEY", f"tensor {key!r} is not part of a PEFT LoRA adapter", _canonical(key)))

    for t in art.tensors.values():
        if t.numel == 0:
            art.add(finding("E_EMPTY_TENSOR", f"tensor {t.name!r} has shape {list(t.shape)}", _canonical(t.name)))

    embedding_seen = False
    for (name, kind), sides in sorted(pairs.items()):
        if set(sides) != {"A", "B"}:
            have = next(iter(sides))
            art.add(finding("E_MISSING_PARTNER", f"lora_{have} has no lora_{'B' if have == 'A' else 'A'}", name))
            continue
        rec = _module_record(art, spec, name, kind, sides["A"], sides["B"])
        if rec is not None:
            art.modules.append(rec)
            embedding_seen |= kind == "embedding"
    if embedding_seen:
        art.add(finding("U_EMBEDDING_LORA", "the adapter holds lora_embedding_A/B factors"))
    if not pairs:
        art.add(finding("E_NO_MODULES", "no lora_A/lora_B tensors found"))
    _check_bias(art, spec)
    _check_patterns(art, spec, sorted({name for name, _ in pairs}))


def _module_record(art: AdapterArtifact, spec: LoraSpec, name: str, kind: str, a: Tensor, b: Tensor) -> ModuleRecord | None:
    ok = True
    for t in (a, b):
        if t.dtype not in FACTOR_DTYPES:
            art.add(finding("E_UNSUPPORTED_DTYPE", f"{t.name!r} is {t.dtype}", name))
            ok = False
    if len(a.shape) != 2 or len(b.shape) != 2:
        art.add(finding("E_FACTOR_SHAPE", f"factors must be 2-D, got A {list(a.shape)} and B {list(b.shape)}", name))
        return None
    if a.shape[0] != b.shape[1]:
        art.add(finding("E_FACTOR_SHAPE", f"A {list(a.shape)} and B {list(b.shape)} disagree on the rank", name))
        return None
    if ok and a.dtype != b.dtype:
        art.add(finding("E_DTYPE_MISMATCH", f"A is {a.dtype}, B is {b.dtype}", name))
        ok = False
    rank, alpha = spec.rank_for(name), spec.alpha_for(name)
    if a.shape[0] != rank:
        art.add(finding("E_RANK_MISMATCH", f"stored rank {a.shape[0]}, config resolves r={rank}", name))
        ok = False
    if not ok:
        return None
    return ModuleRecord(
        name=name, kind=kind, a=a, b=b, rank=rank, alpha=alpha,
        scale=spec.scale(rank, alpha), scale_rule=spec.scale_rule,
    )


def _explained_extra(spec: LoraSpec, name: str, tensors: dict[str, Tensor]) -> bool:
    """True for a non-factor tensor that an (unservable) PEFT feature the config
    declares would write; such tensors are hashed into the identity."""
    if spec.use_dora and (name.endswith(".lora_magnitude_vector") or name.endswith(".lora_magnitude_vector.weight")):
        return True
    if spec.lora_bias and name.endswith(".lora_B.bias"):
        return True
    if spec.bias != "none" and name.endswith(".bias"):
        return True
    if spec.modules_to_save and any(re.match(rf"(^|.*\.){m}($|\..*)", name) for m in spec.modules_to_save):
        return True
    if spec.trainable_token_indices and ".token_adapter." in name:
        return True
    if name.endswith(".base_layer.weight"):  # embedding layer saved beside its LoRA factors
        module = name[: -len(".base_layer.weight")]
        return any(_canonical(k).startswith(module + ".lora_embedding_") for k in tensors)
    return False


def _check_bias(art: AdapterArtifact, spec: LoraSpec) -> None:
    """``bias`` != "none", judged by what the file holds: trained base biases are unservable
    (mlora serves the base's own); with none (a base without biases) the adapter is the plain
    LoRA it stores, as PEFT serves it, and the field is inert."""
    if spec.bias == "none":
        return
    held = sorted(k for k in art.extra if k.endswith(".bias") and not (spec.lora_bias and k.endswith(".lora_B.bias")))
    if held:
        art.add(finding("U_BIAS", f"bias is {spec.bias!r} and the file holds {len(held)} trained bias tensor(s), "
                                  f"e.g. {held[0]!r}"))
    else:
        art.add(finding("W_BIAS_INERT", f"bias is {spec.bias!r} and the file holds no bias tensor"))


def _check_patterns(art: AdapterArtifact, spec: LoraSpec, names: list[str]) -> None:
    """A pattern key that matches none of the stored factor modules (a module whose factors are
    malformed still counts: the key does match it)."""
    for label, patterns in (("rank_pattern", spec.rank_pattern), ("alpha_pattern", spec.alpha_pattern)):
        for key in patterns:
            if not any(pattern_key({key: None}, n) is not None for n in names):
                art.add(finding("W_PATTERN_UNMATCHED", f"{label} key {key!r} matches no adapted module"))


# ---- value scan ---------------------------------------------------------------


def scan_adapters(arts: list[AdapterArtifact], workers: int | None = None) -> None:
    """Stream every tensor of every adapter once (all adapters share one thread
    pool): fill factor and extra-tensor digests, add E_NON_FINITE and
    W_ZERO_DELTA findings."""
    jobs: list[tuple[AdapterArtifact, str, Tensor, ModuleRecord | None]] = []
    for art in arts:
        for rec in art.modules:
            jobs.append((art, "A", rec.a, rec))
            jobs.append((art, "B", rec.b, rec))
        for t in art.extra.values():
            jobs.append((art, "extra", t, None))
    file_jobs = [i for i, j in enumerate(jobs) if isinstance(j[2], TensorInfo)]
    results: list[TensorScan | SafetensorsError | None] = [None] * len(jobs)
    for i, res in zip(file_jobs, scan_many([(jobs[i][2], True) for i in file_jobs], workers)):
        results[i] = res
    for i, (_, _, t, _) in enumerate(jobs):
        if isinstance(t, MemTensor):
            results[i] = scan_bytes(t.data, t.dtype, t.shape, check_values=True)

    for (art, side, t, rec), res in zip(jobs, results):
        module = rec.name if rec else _canonical(t.name)
        if isinstance(res, SafetensorsError):
            art.add(finding(res.code, str(res), module))
            continue
        assert res is not None
        if res.non_finite:
            art.add(finding("E_NON_FINITE", f"{t.name!r} has {res.non_finite} NaN/Inf values", module))
        if side == "A":
            rec.a_sha256 = res.sha256
        elif side == "B":
            rec.b_sha256 = res.sha256
            if res.all_zero:
                art.add(finding("W_ZERO_DELTA", "lora_B is all zeros", module))
        else:
            art.extra_sha256[t.name] = res.sha256
    for art in arts:
        art.scanned = True


# ---- checks against a base ----------------------------------------------------


def check_against_base(art: AdapterArtifact, base) -> None:
    """Findings of ``art`` against a :class:`~mlora.lora_tools.base.BaseCheckpoint`:
    absent targets, shape mismatches, declared-name drift, target-set drift."""
    shapes = base.module_shapes
    for rec in art.modules:
        if rec.name not in shapes:
            art.add(finding("E_TARGET_NOT_IN_BASE", f"base {base.name!r} has no module {rec.name!r}", rec.name))
            continue
        if rec.kind == "embedding":
            want = (rec.d_in, rec.d_out)  # embedding weight is [num_embeddings, dim]
        elif art.spec is not None and art.spec.fan_in_fan_out:
            want = (rec.d_in, rec.d_out)  # Conv1D stores [d_in, d_out]
        else:
            want = (rec.d_out, rec.d_in)
        if tuple(shapes[rec.name]) != want:
            art.add(finding(
                "E_BASE_SHAPE_MISMATCH",
                f"factors imply a {list(want)} weight, base has {list(shapes[rec.name])}", rec.name,
            ))
    spec = art.spec
    if spec is None:
        return
    _check_declared_base(art, spec, base)
    vocab = base.config.get("vocab_size")
    outside = [t for t in spec.alora_invocation_tokens or () if isinstance(vocab, int) and t >= vocab]
    if outside:
        art.add(finding("E_ALORA_INVOCATION", f"alora_invocation_tokens holds {outside}, outside the base's "
                        f"vocabulary of {vocab} token ids: no prompt can contain them"))
    if spec.target_modules is not None and art.modules:
        expected = {n for n in shapes if module_is_targeted(spec, n, base.linear_modules)}
        actual = {m.name for m in art.modules if m.name in shapes}  # the others are E_TARGET_NOT_IN_BASE
        missing, surplus = sorted(expected - actual), sorted(actual - expected)
        if missing or surplus:
            detail = []
            if missing:
                detail.append(f"config targets {len(missing)} module(s) without factors, e.g. {missing[:3]}")
            if surplus:
                detail.append(f"{len(surplus)} factor module(s) the config does not target, e.g. {surplus[:3]}")
            art.add(finding("W_TARGET_SET_MISMATCH", "; ".join(detail)))


def _check_declared_base(art: AdapterArtifact, spec: LoraSpec, base) -> None:
    declared = spec.base_model_name_or_path
    if declared:
        leaf = declared.rstrip("/").rsplit("/", 1)[-1]
        known = {base.name}
        if isinstance(base.config.get("_name_or_path"), str):
            known.add(base.config["_name_or_path"].rstrip("/").rsplit("/", 1)[-1])
        if leaf not in known:
            art.add(finding("W_BASE_NAME_MISMATCH", f"adapter declares base {declared!r}, given {base.name!r}"))
    rev = base.config.get("_commit_hash")
    if spec.revision and isinstance(rev, str) and rev != spec.revision:
        art.add(finding("W_BASE_NAME_MISMATCH", f"adapter declares revision {spec.revision!r}, base is {rev!r}"))


def rank_histogram(art: AdapterArtifact) -> dict[str, int]:
    return {str(r): n for r, n in sorted(Counter(m.rank for m in art.modules).items())}
