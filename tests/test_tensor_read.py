"""Verified tensor reads (mlora.lora_tools.safetensors_io.read_verified): the one reader behind
pinned batch adapters, compression members, merge factors and release verification."""

import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from mlora.lora_tools.adapter import MemTensor
from mlora.lora_tools.safetensors_io import (
    TensorChanged,
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
