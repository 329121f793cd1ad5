"""Hugging Face base checkpoints: lazy reading and the base execution identity.

Owns a base model directory (``config.json`` plus ``model.safetensors`` or a
sharded ``model.safetensors.index.json``): its tensor table, its linear-module
map, and ``base_sha256`` (docs/design.md, Base identity)::

    base_sha256 = SHA256(canonical({
        "model_weights_sha256":     SHA256(canonical({"tensors": [{name, dtype, shape, sha256}, ...]})),
        "model_config_sha256":      SHA256(canonical(config.json minus provenance keys, floats tagged)),
        "weight_transform_sha256":  SHA256(canonical({"transform": "identity"})),
        "target_module_map_sha256": SHA256(canonical({"modules": [{name, shape: [d_out, d_in]}, ...]})),
    }))

Tensors are streamed from disk in fixed chunks (never the whole model in RAM)
and hashed on all cores. The sharding of a checkpoint does not enter the
identity: the same tensors re-sharded hash the same. Must not know adapters.

Which files hold the weights (:func:`weight_files`, also the batch model's
loader): the shard index, else ``model.safetensors``; for an mlora release
(``release.json``, docs/release.md) the release's own record, and a release
holding any file its record does not list is refused, as ``release verify``
reports it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cached_property

from mlora.lora_tools.canonical import canonicalize_floats, digest, sealed_digest
from mlora.lora_tools.safetensors_io import SafetensorsError, TensorInfo, read_header, scan_many

# config.json keys that record where or by which library version a file was
# written, not what the model computes.
PROVENANCE_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})

# Output layers PEFT's "all-linear" leaves out, and embedding tables (2-D
# weights that are not linear projections).
OUTPUT_LAYER_NAMES = frozenset({"lm_head", "embed_out", "output"})
EMBEDDING_LEAF_NAMES = frozenset({"embed_tokens", "wte", "wpe", "word_embeddings", "embed_in", "embed_positions"})


RELEASE_FILE = "release.json"  # the sealed record of an mlora release (mlora.lora_tools.release)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class BaseCheckpointError(ValueError):
    """The directory is not a readable base checkpoint (finding E_BASE_INVALID)."""


def release_record(path: str) -> dict | None:
    """The record (``release.json``) of the mlora release at ``path``, its seal checked;
    None when ``path`` holds no record. Raises BaseCheckpointError when it is unreadable or edited."""
    file = os.path.join(path, RELEASE_FILE)
    if not os.path.lexists(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError) as exc:
        raise BaseCheckpointError(f"{file} cannot be read ({exc})") from None
    if not isinstance(record, dict) or sealed_digest(record, "release_sha256") != record.get("release_sha256"):
        raise BaseCheckpointError(f"{file} does not hash to its release_sha256: edited")
    return record


def unlisted_files(path: str, record: dict) -> list[str]:
    """Entries of the release directory ``path`` that its record does not list: a loader
    could read any of them (an index, a weight file, a tokenizer), the release never held them."""
    listed = record.get("files")
    listed = set(listed) if isinstance(listed, dict) else set()
    return sorted(e for e in os.listdir(path) if e not in listed and e != RELEASE_FILE)


def weight_files(path: str) -> tuple[list[str], dict[str, str] | None]:
    """The weight files a loader reads in the checkpoint directory ``path`` (names in it) and
    the map placing each tensor in one of them (None: the one file holds every tensor).
    An mlora release answers from its record, never from an index beside it."""
    record = release_record(path)
    if record is not None:
        extra = unlisted_files(path, record)
        if extra:
            raise BaseCheckpointError(f"{path} is an mlora release holding files its {RELEASE_FILE} does not list "
                                      f"({', '.join(extra)}), which a loader could read: it was altered; remove "
                                      f"them or restore the release, and check it with `mlora release verify`")
        try:
            weight_map = {name: rec["file"] for name, rec in record["tensors"].items()}
        except (KeyError, TypeError, AttributeError) as exc:
            raise BaseCheckpointError(f"{path}/{RELEASE_FILE}: no readable tensor table ({exc})") from None
    elif os.path.isfile(os.path.join(path, INDEX_FILE)):
        index = os.path.join(path, INDEX_FILE)
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BaseCheckpointError(f"{index}: unreadable shard index ({exc})") from None
        if not isinstance(weight_map, dict):
            raise BaseCheckpointError(f"{index}: weight_map is not an object")
    elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
        return [SINGLE_FILE], None
    else:
        raise BaseCheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}")
    shards = sorted(set(weight_map.values()), key=str)
    for shard in shards:
        if not isinstance(shard, str) or os.path.basename(shard) != shard or not os.path.isfile(os.path.join(path, shard)):
            raise BaseCheckpointError(f"{path}: shard {shard!r} is missing")
    return shards, weight_map


@dataclass(frozen=True)
class BaseIdentity:
    model_weights_sha256: str
    model_config_sha256: str
    weight_transform_sha256: str
    target_module_map_sha256: str
    base_sha256: str

    def to_json(self) -> dict:
        return dict(self.__dict__)


class BaseCheckpoint:
    """A Hugging Face model directory read lazily (headers only until hashed)."""

    def __init__(self, path: str):
        self.path = path
        self.name = os.path.basename(os.path.normpath(path))
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise BaseCheckpointError(f"{path}: no config.json")
        try:
            with open(cfg_path, encoding="utf-8") as f:
                self.config = json.load(f)
        except (OSError, ValueError) as exc:
            raise BaseCheckpointError(f"{cfg_path}: not readable JSON ({exc})") from None
        if not isinstance(self.config, dict):
            raise BaseCheckpointError(f"{cfg_path}: not a JSON object")
        self.tensors = self._read_tensor_table()

    def _read_tensor_table(self) -> dict[str, TensorInfo]:
        shards, weight_map = weight_files(self.path)
        tensors: dict[str, TensorInfo] = {}
        for shard in shards:
            shard_path = os.path.join(self.path, shard)
            try:
                header = read_header(shard_path)
            except SafetensorsError as exc:
                raise BaseCheckpointError(f"{shard_path}: {exc}") from None
            for name, info in header.tensors.items():
                if name in tensors:
                    raise BaseCheckpointError(f"{self.path}: tensor {name!r} appears in two shards")
                if weight_map is not None and weight_map.get(name) != shard:
                    raise BaseCheckpointError(f"{self.path}: index places {name!r} in {weight_map.get(name)!r}, found in {shard!r}")
                tensors[name] = info
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(tensors))
            if missing:
                raise BaseCheckpointError(f"{self.path}: index lists tensors no shard holds: {missing[:5]}")
        return tensors

    # ---- module map ------------------------------------------------------------

    @cached_property
    def module_shapes(self) -> dict[str, tuple[int, ...]]:
        """Module name -> weight shape for every ``<module>.weight`` tensor, plus
        ``lm_head`` when it is tied to the input embedding and not stored."""
        shapes = {k[: -len(".weight")]: v.shape for k, v in self.tensors.items() if k.endswith(".weight")}
        if "lm_head" not in shapes and self.config.get("tie_word_embeddings", True):
            for name, shape in shapes.items():
                if name.rsplit(".", 1)[-1] in ("embed_tokens", "wte", "word_embeddings", "embed_in"):
                    shapes["lm_head"] = shape
                    break
        return shapes

    @cached_property
    def linear_modules(self) -> frozenset[str]:
        """Modules with a 2-D weight that are linear projections: what PEFT's
        ``all-linear`` targets (embeddings and the output layer excluded)."""
        out = set()
        for name, shape in self.module_shapes.items():
            leaf = name.rsplit(".", 1)[-1]
            if len(shape) == 2 and leaf not in EMBEDDING_LEAF_NAMES and name not in OUTPUT_LAYER_NAMES:
                out.add(name)
        return frozenset(out)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    # ---- identity ----------------------------------------------------------------

    def identity(self, workers: int | None = None) -> BaseIdentity:
        """Hash every tensor (streamed, parallel) and derive ``base_sha256``."""
        names = sorted(self.tensors)
        scans = scan_many([(self.tensors[n], False) for n in names], workers)
        records = []
        for name, scan in zip(names, scans):
            if isinstance(scan, SafetensorsError):
                raise BaseCheckpointError(f"{self.path}: {scan}")
            info = self.tensors[name]
            records.append({"name": name, "dtype": info.dtype, "shape": list(info.shape), "sha256": scan.sha256})
        self.tensor_digests = {r["name"]: r["sha256"] for r in records}  # reused by release.merge
        weights = digest({"tensors": records})
        config = digest(
            canonicalize_floats({k: v for k, v in self.config.items() if k not in PROVENANCE_CONFIG_KEYS})
        )
        transform = digest({"transform": "identity"})
        target_map = digest(
            {"modules": [{"name": n, "shape": list(self.module_shapes[n])} for n in sorted(self.linear_modules)]}
        )
        return BaseIdentity(
            model_weights_sha256=weights,
            model_config_sha256=config,
            weight_transform_sha256=transform,
            target_module_map_sha256=target_map,
            base_sha256=digest(
                {
                    "model_weights_sha256": weights,
                    "model_config_sha256": config,
                    "weight_transform_sha256": transform,
                    "target_module_map_sha256": target_map,
                }
            ),
        )
