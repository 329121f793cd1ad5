"""Verified tensor reads (mlora.lora_tools.safetensors_io.read_verified): the one reader behind
pinned batch adapters, compression members, merge factors and release verification."""

import json
import os
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from mlora.lora_tools.adapter import MemTensor
from mlora.lora_tools.safetensors_io import (
    DTYPE_BYTES,
    MAX_HEADER_BYTES,
    SafetensorsError,
    TensorChanged,
    numel,
    read_header,
    read_tensor_bytes,
    read_verified,
    scan_tensor,
    tensor_sha256,
)


@pytest.fixture()
def stored(tmp_path):
    """A safetensors file of two tensors, their infos and digests as a scan measures them."""
    path = str(tmp_path / "t.safetensors")
    save_file({"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)},
              path)
    infos = read_header(path).tensors
    return path, infos, {n: scan_tensor(i).sha256 for n, i in infos.items()}


def test_read_verified_returns_the_stored_bytes_writable(stored):
    path, infos, digests = stored
    data = read_verified(infos["a"], digests["a"])
    assert isinstance(data, bytearray) and len(data) == infos["a"].nbytes
    assert torch.equal(torch.frombuffer(data, dtype=torch.float32).reshape(3, 4),
                       torch.arange(12, dtype=torch.float32).reshape(3, 4))
    fd = os.open(path, os.O_RDONLY)  # an open descriptor is read from and left open
    try:
        assert read_verified(infos["b"], digests["b"], fd) == read_tensor_bytes(infos["b"])
        os.fstat(fd)
    finally:
        os.close(fd)


def test_a_flipped_byte_and_a_truncated_file_are_told_apart(stored):
    path, infos, digests = stored
    raw = bytearray(open(path, "rb").read())
    raw[infos["a"].offset + 1] ^= 0x01
    open(path, "wb").write(raw)
    with pytest.raises(TensorChanged) as exc:
        read_verified(infos["a"], digests["a"])
    assert exc.value.short is False and exc.value.name == "a"
    assert read_verified(infos["b"], digests["b"])  # the other tensor is untouched
    os.truncate(path, infos["b"].offset + 3)
    assert len(read_tensor_bytes(infos["b"])) == 3
    with pytest.raises(TensorChanged) as exc:
        read_verified(infos["b"], digests["b"])
    assert exc.value.short is True


def test_a_tensor_in_memory_is_verified_alike():
    data = np.arange(6, dtype="<f4").tobytes()
    t = MemTensor("m", "F32", (2, 3), data)
    digest = tensor_sha256("F32", [2, 3], data)
    assert read_verified(t, digest) == bytearray(data)
    with pytest.raises(TensorChanged):
        read_verified(t, tensor_sha256("F32", [3, 2], data))  # the shape is part of the digest


# ---- the header reader is at least as strict as the safetensors library --------------------
#
# mlora checks and hashes every safetensors file with its own bounded reader (read_header); the
# batch engine then loads the base's weights with safetensors' safe_open. A file mlora accepts must
# therefore open with safe_open, to the same tensor table: any file the library refuses, mlora
# refuses first, with a finding code.


def _raw(path, header, data: bytes, header_len=None) -> str:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text) if header_len is None else header_len) + text + data)
    return str(path)


def _t(dtype, shape, start, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


def _library_opens(path) -> bool:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            f.keys()
    except SafetensorError:
        return False
    return True


A8, B16 = _t("F32", [2], 0, 8), _t("F16", [4], 8, 16)
CRAFTED = {
    # name: (header, data, header_len or None, finding code)
    "gap-between-tensors": ({"a": A8, "b": _t("F16", [4], 12, 20)}, bytes(20), None, "E_SAFETENSORS_HEADER"),
    "gap-before-first": ({"a": _t("F32", [2], 4, 12)}, bytes(12), None, "E_SAFETENSORS_HEADER"),
    "trailing-bytes": ({"a": A8, "b": B16}, bytes(17), None, "E_SAFETENSORS_HEADER"),
    "trailing-bytes-no-tensor": ({}, bytes(1), None, "E_SAFETENSORS_HEADER"),
    "overlap": ({"a": A8, "b": _t("F16", [4], 4, 12)}, bytes(12), None, "E_SAFETENSORS_HEADER"),
    "same-range-twice": ({"a": A8, "b": _t("F32", [2], 0, 8)}, bytes(8), None, "E_SAFETENSORS_HEADER"),
    "end-before-start": ({"a": _t("F32", [0], 8, 0)}, bytes(8), None, "E_SAFETENSORS_HEADER"),
    "short-data": ({"a": A8, "b": B16}, bytes(15), None, "E_SAFETENSORS_TRUNCATED"),
    "size-vs-shape": ({"a": _t("F32", [3], 0, 8)}, bytes(8), None, "E_SAFETENSORS_HEADER"),
    "header-just-over-the-limit": ({}, b"", 100_000_001, "E_SAFETENSORS_HEADER"),
    "header-longer-than-file": ({}, b"", 1000, "E_SAFETENSORS_TRUNCATED"),
    "not-an-object": ([1, 2], b"", None, "E_SAFETENSORS_HEADER"),
    "metadata-list": ({"__metadata__": [], "a": A8}, bytes(8), None, "E_SAFETENSORS_HEADER"),
    "metadata-false": ({"__metadata__": False, "a": A8}, bytes(8), None, "E_SAFETENSORS_HEADER"),
    "metadata-not-strings": ({"__metadata__": {"n": 1}, "a": A8}, bytes(8), None, "E_SAFETENSORS_HEADER"),
    "entry-not-object": ({"a": [0, 8]}, bytes(8), None, "E_SAFETENSORS_HEADER"),
    "entry-missing-offsets": ({"a": {"dtype": "F32", "shape": [2]}}, bytes(8), None, "E_SAFETENSORS_HEADER"),
    "dtype-unknown": ({"a": _t("F17", [2], 0, 8)}, bytes(8), None, "E_SAFETENSORS_HEADER"),
    "dtype-lower-case": ({"a": _t("f32", [2], 0, 8)}, bytes(8), None, "E_SAFETENSORS_HEADER"),
    "dtype-a-list": ({"a": _t(["F32"], [2], 0, 8)}, bytes(8), None, "E_SAFETENSORS_HEADER"),
    "shape-float": ({"a": _t("F32", [2.0], 0, 8)}, bytes(8), None, "E_SAFETENSORS_HEADER"),
    "shape-negative": ({"a": _t("F32", [-2], 0, 8)}, bytes(8), None, "E_SAFETENSORS_HEADER"),
    "shape-bool": ({"a": _t("F32", [True, 2], 0, 8)}, bytes(8), None, "E_SAFETENSORS_HEADER"),
    "shape-over-u64": ({"a": _t("F32", [2**64, 0], 0, 0)}, b"", None, "E_SAFETENSORS_HEADER"),
    "shape-product-overflows": ({"a": _t("F32", [2**32, 2**32, 0], 0, 0)}, b"", None, "E_SAFETENSORS_HEADER"),
    "byte-count-overflows": ({"a": _t("F32", [2**62], 0, 0)}, b"", None, "E_SAFETENSORS_HEADER"),
    "offsets-three": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 8]}}, bytes(8), None,
                      "E_SAFETENSORS_HEADER"),
    "offsets-negative": ({"a": _t("F32", [2], -1, 7)}, bytes(8), None, "E_SAFETENSORS_HEADER"),
    "duplicate-name": (b'{"a":' + json.dumps(A8).encode() + b',"a":' + json.dumps(_t("F32", [2], 8, 16)).encode()
                       + b"}", bytes(16), None, "E_SAFETENSORS_HEADER"),
    "nan-in-entry": (b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":NaN}}', bytes(8), None,
                     "E_SAFETENSORS_HEADER"),
    "float-out-of-range": (b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1e400}}', bytes(8), None,
                           "E_SAFETENSORS_HEADER"),
    "lone-surrogate": (b'{"\\ud800":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(8), None,
                       "E_SAFETENSORS_HEADER"),
    "not-utf8": (b'{"\xff":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(8), None,
                 "E_SAFETENSORS_HEADER"),
    "nul-padding": (json.dumps({"a": A8}).encode() + b"\0\0", bytes(8), None, "E_SAFETENSORS_HEADER"),
    "deeply-nested": (b"[" * 100_000 + b"]" * 100_000, b"", None, "E_SAFETENSORS_HEADER"),
    "empty-header": (b"", b"", None, "E_SAFETENSORS_HEADER"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_file_is_refused_like_the_library_refuses_it(tmp_path, case):
    header, data, header_len, code = CRAFTED[case]
    path = _raw(tmp_path / "x.safetensors", header, data, header_len)
    assert not _library_opens(path)
    with pytest.raises(SafetensorsError) as exc:
        read_header(path)
    assert exc.value.code == code, str(exc.value)


def test_a_duplicate_key_is_refused_even_where_the_library_keeps_the_last(tmp_path):
    """Stricter than the library on purpose: with a key twice, which entry counts is the parser's choice."""
    text = b'{"a":' + json.dumps(A8).encode() + b',"a":' + json.dumps(A8).encode() + b"}"
    with pytest.raises(SafetensorsError, match="twice") as exc:
        read_header(_raw(tmp_path / "x.safetensors", text, bytes(8)))
    assert exc.value.code == "E_SAFETENSORS_HEADER"


def test_header_at_the_limit_is_read_and_one_byte_more_is_not(tmp_path):
    pad = MAX_HEADER_BYTES - len(json.dumps({"a": A8}))
    path = _raw(tmp_path / "x.safetensors", json.dumps({"a": A8}).encode() + b" " * pad, bytes(8))
    assert MAX_HEADER_BYTES == 100_000_000 and os.path.getsize(path) == 8 + MAX_HEADER_BYTES + 8
    assert _library_opens(path) and list(read_header(path).tensors) == ["a"]
    os.truncate(path, 0)
    path = _raw(path, json.dumps({"a": A8}).encode() + b" " * (pad + 1), bytes(8))
    assert not _library_opens(path)
    with pytest.raises(SafetensorsError, match="100000000"):
        read_header(path)


_TORCH_DTYPE_NAMES = {
    "F64": "torch.float64", "F32": "torch.float32", "F16": "torch.float16", "BF16": "torch.bfloat16",
    "I64": "torch.int64", "I32": "torch.int32", "I16": "torch.int16", "I8": "torch.int8", "U64": "torch.uint64",
    "U32": "torch.uint32", "U16": "torch.uint16", "U8": "torch.uint8", "BOOL": "torch.bool",
    "F8_E4M3": "torch.float8_e4m3fn", "F8_E5M2": "torch.float8_e5m2", "F8_E8M0": "torch.float8_e8m0fnu",
}


def _random_valid(rng) -> tuple[dict, bytes]:
    """A valid header (random dtypes, shapes, order, metadata, zero-size tensors) and its data."""
    header, off = {}, 0
    for i in range(int(rng.integers(0, 5))):
        dtype = str(rng.choice(sorted(DTYPE_BYTES)))
        shape = [int(d) for d in rng.integers(0, 4, size=int(rng.integers(0, 3)))]
        n = numel(shape) * DTYPE_BYTES[dtype]
        header[f"t{i}"] = _t(dtype, shape, off, off + n)
        off += n
    names = list(header)
    rng.shuffle(names)
    header = {k: header[k] for k in names}
    if rng.random() < 0.3:
        header["__metadata__"] = {"format": "pt"}
    return header, bytes(rng.integers(0, 256, size=off, dtype=np.uint8))


def _mutate(rng, header: dict, data: bytes) -> tuple[bytes, bytes]:
    """One random change of a valid file: most make it invalid, some keep it valid."""
    names = [k for k in header if k != "__metadata__"]
    kind = int(rng.integers(0, 10))
    if names and kind < 5:
        entry = header[str(rng.choice(names))]
        field, delta = ("data_offsets", "shape", "dtype")[kind % 3], int(rng.integers(-2, 3))
        if field == "data_offsets":
            entry["data_offsets"][int(rng.integers(0, 2))] += delta
        elif field == "shape" and entry["shape"]:
            entry["shape"][int(rng.integers(0, len(entry["shape"])))] += delta
        else:
            entry["dtype"] = str(rng.choice(sorted(DTYPE_BYTES) + ["F4", "C64", "f32"]))
    elif kind == 5:
        data += bytes(int(rng.integers(0, 3)))
    elif kind == 6:
        data = data[: max(0, len(data) - int(rng.integers(0, 3)))]
    text = json.dumps(header).encode()
    if kind == 7:  # flip one byte of the header text
        pos = int(rng.integers(0, len(text)))
        text = text[:pos] + bytes([int(rng.integers(0, 256))]) + text[pos + 1:]
    elif kind == 8:
        text = text + b" " * int(rng.integers(0, 3)) + (b"\0" if rng.random() < 0.5 else b"")
    return text, data


def test_every_file_mlora_reads_opens_with_safe_open_to_the_same_table(tmp_path):
    """Seeded random valid files and one-change mutants of them: whenever read_header accepts a file,
    safe_open opens it and reads the same names, dtypes, shapes and bytes; the valid ones are accepted."""
    from safetensors import safe_open

    rng = np.random.default_rng(20240)
    accepted = refused = 0
    for i in range(400):
        header, data = _random_valid(rng)
        text, data = (json.dumps(header).encode(), data) if i % 4 == 0 else _mutate(rng, header, data)
        path = _raw(tmp_path / f"f{i}.safetensors", text, data)
        try:
            infos = read_header(path).tensors
        except SafetensorsError:
            refused += 1
            assert i % 4, f"a valid file was refused: {text!r}"
            continue
        accepted += 1
        assert _library_opens(path), f"mlora accepts what safe_open refuses: {text!r} + {len(data)} bytes"
        with safe_open(path, framework="pt") as f:
            assert sorted(f.keys()) == sorted(infos)
            for name, info in infos.items():
                t = f.get_tensor(name)
                assert list(t.shape) == list(info.shape) and str(t.dtype) == _TORCH_DTYPE_NAMES[info.dtype]
                assert t.reshape(-1).view(torch.uint8).numpy().tobytes() == bytes(read_tensor_bytes(info))
    assert accepted > 100 and refused > 100
