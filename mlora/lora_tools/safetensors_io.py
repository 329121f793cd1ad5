"""Bounded, lazy reading of safetensors files, parallel tensor hashing, verified tensor reads.

Owns the safetensors byte layout: the 8-byte little-endian header length, the
JSON header, and tensor byte ranges. Reads only the header up front (bounded:
an oversized or lying header never causes a large allocation) and streams
tensor bytes in fixed-size chunks, so memory stays flat whatever the file size.
Owns too the one reader that checks a tensor's bytes against a digest known
beforehand (:func:`read_verified`: pinned batch adapters, compression members,
merge factors, release verification). Must not interpret tensor names: that
is the adapter and base readers' job.

Tensor digest (docs/identity.md)::

    tensor_sha256 = SHA256( canonical_json({"dtype": DTYPE, "shape": SHAPE}) + b"\\n" + raw_bytes )

where ``raw_bytes`` are the little-endian element bytes in the stored
(row-major, logical) order, exactly as safetensors stores them. Dtype and
shape are bound into the digest, so a reshape or a dtype relabel changes it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from mlora.lora_tools.canonical import canonical_json

# The safetensors library's header bound (its MAX_HEADER_SIZE, in bytes): a longer header is
# refused before anything is allocated, as safe_open refuses it.
MAX_HEADER_BYTES = 100_000_000
U64_LIMIT = 1 << 64  # shapes, offsets and byte counts are u64 in the library; larger is refused
CHUNK_BYTES = 8 * 1024 * 1024  # multiple of every element size

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}

# Per float dtype: (unsigned type of the same width, magnitude mask, exponent
# mask). With the sign bit cleared, an element is NaN/Inf iff its magnitude
# bits are >= the all-ones exponent, and zero iff they are 0; so one masked
# max() answers both questions for a chunk.
_FLOAT_BITS = {
    "F64": (np.dtype("<u8"), 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
    "F32": (np.dtype("<u4"), 0x7FFFFFFF, 0x7F800000),
    "F16": (np.dtype("<u2"), 0x7FFF, 0x7C00),
    "BF16": (np.dtype("<u2"), 0x7FFF, 0x7F80),
}


class SafetensorsError(ValueError):
    """A malformed safetensors file. ``code`` is a finding code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def numel(shape: tuple[int, ...] | list[int]) -> int:
    """Element count of a shape (1 for a scalar)."""
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live: ``path`` and absolute byte ``offset``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: str
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return numel(self.shape)


@dataclass
class SafetensorsHeader:
    path: str
    file_size: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)


def read_header(path: str) -> SafetensorsHeader:
    """Parse and check a safetensors header without reading tensor data.

    At least as strict as the safetensors library (a file accepted here opens
    with ``safe_open`` to the same tensor table): the header is at most
    MAX_HEADER_BYTES of UTF-8 JSON, one object without duplicate keys,
    ``__metadata__`` null or an object of strings, every tensor a known dtype, a
    u64 shape and ``data_offsets`` whose range is shape x dtype bytes long; the
    ranges, sorted, tile the data section exactly from byte 0 (no gap, no
    overlap, no trailing byte).

    Raises SafetensorsError with ``E_SAFETENSORS_TRUNCATED`` when the file is
    shorter than the header or the data it declares, and ``E_SAFETENSORS_HEADER``
    for anything else the header gets wrong."""
    file_size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise SafetensorsError("E_SAFETENSORS_TRUNCATED", f"{file_size}-byte file has no 8-byte header length")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:
            raise SafetensorsError(
                "E_SAFETENSORS_HEADER",
                f"header length {header_len} exceeds the safetensors format's {MAX_HEADER_BYTES}-byte limit",
            )
        if 8 + header_len > file_size:
            raise SafetensorsError(
                "E_SAFETENSORS_TRUNCATED", f"header declares {header_len} bytes but the file has {file_size - 8}"
            )
        raw = f.read(header_len)
    header = _parse_header_json(raw)

    data_start = 8 + header_len
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError("E_SAFETENSORS_HEADER", "__metadata__ is not an object of strings")
    tensors = {name: _tensor_info(path, name, entry, data_start) for name, entry in header.items()}
    _check_layout(tensors, data_start, file_size)
    return SafetensorsHeader(path=path, file_size=file_size, tensors=tensors, metadata=metadata)


def _parse_header_json(raw: bytes) -> dict:
    """The header as a dict, parsed as strictly as the library's JSON reader: no duplicate key,
    no NaN/Infinity, no number outside u64/i64/f64, no lone surrogate, no nesting deep
    enough to exhaust the stack."""
    try:
        header = json.loads(
            raw.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_refuse_constant,
            parse_int=_bounded_int, parse_float=_finite_float,
        )
    except UnicodeDecodeError as exc:
        raise SafetensorsError("E_SAFETENSORS_HEADER", f"header is not UTF-8 ({exc})") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and the hooks' refusals are ValueErrors
        raise SafetensorsError("E_SAFETENSORS_HEADER", f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsError("E_SAFETENSORS_HEADER", "header is not a JSON object")
    if _has_lone_surrogate(header):
        raise SafetensorsError("E_SAFETENSORS_HEADER", "header holds a lone UTF-16 surrogate escape (\\uD800-\\uDFFF)")
    return header


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice in one object")
        out[key] = value
    return out


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _bounded_int(text: str) -> int:
    value = int(text)
    if not -(1 << 63) <= value < U64_LIMIT:
        raise ValueError(f"integer {text[:40]} does not fit 64 bits")
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _has_lone_surrogate(value: object) -> bool:
    """True when a key or string holds an unpaired surrogate (only a ``\\uD8xx`` escape makes one)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(v, dict):
            stack.extend(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def _is_u64(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < U64_LIMIT


def _tensor_info(path: str, name: str, entry: object, data_start: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise SafetensorsError("E_SAFETENSORS_HEADER", f"entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise SafetensorsError("E_SAFETENSORS_HEADER", f"tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_u64(d) for d in shape):
        raise SafetensorsError("E_SAFETENSORS_HEADER", f"tensor {name!r} has an invalid shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_u64(o) for o in offsets) \
            or offsets[0] > offsets[1]:
        raise SafetensorsError("E_SAFETENSORS_HEADER", f"tensor {name!r} has invalid data_offsets {offsets!r}")
    need = 1
    for d in [*shape, DTYPE_BYTES[dtype]]:  # checked at every step, as the library does
        need *= d
        if need >= U64_LIMIT:
            raise SafetensorsError(
                "E_SAFETENSORS_HEADER", f"tensor {name!r}: shape {shape} x {dtype} overflows a 64-bit byte count"
            )
    nbytes = offsets[1] - offsets[0]
    if need != nbytes:
        raise SafetensorsError(
            "E_SAFETENSORS_HEADER", f"tensor {name!r}: shape {shape} x {dtype} needs {need} bytes, header gives {nbytes}"
        )
    return TensorInfo(name, dtype, tuple(shape), path, data_start + offsets[0], nbytes)


def _check_layout(tensors: dict[str, TensorInfo], data_start: int, file_size: int) -> None:
    """The byte ranges, sorted by (start, end), must tile the data section (``data_start`` to the
    file's end) exactly: each starts where the previous one ends, the first at 0, the last at the end."""
    data_bytes, end = file_size - data_start, 0
    for info in sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes)):
        start = info.offset - data_start
        if start > end:
            raise SafetensorsError(
                "E_SAFETENSORS_HEADER", f"tensor {info.name!r} starts at data byte {start}, after the previous "
                f"tensor's end at {end}: {start - end} bytes belong to no tensor",
            )
        if start < end:
            raise SafetensorsError(
                "E_SAFETENSORS_HEADER", f"tensor {info.name!r} starts at data byte {start}, inside another tensor "
                f"(which ends at {end}): tensors overlap",
            )
        end = start + info.nbytes
    if end > data_bytes:
        raise SafetensorsError(
            "E_SAFETENSORS_TRUNCATED", f"data ends at byte {end} of the data section but the file holds {data_bytes}"
        )
    if end < data_bytes:
        raise SafetensorsError(
            "E_SAFETENSORS_HEADER", f"the tensors end at byte {end} of the data section but the file holds "
            f"{data_bytes}: {data_bytes - end} trailing bytes belong to no tensor",
        )


def tensor_digest_prefix(dtype: str, shape: tuple[int, ...] | list[int]) -> bytes:
    """The bytes hashed before a tensor's data (see the module docstring)."""
    return canonical_json({"dtype": dtype, "shape": list(shape)}) + b"\n"


def tensor_sha256(dtype: str, shape: tuple[int, ...] | list[int], data) -> str:
    """The tensor digest of ``data`` (any bytes-like object) stored as ``dtype`` and ``shape``."""
    h = hashlib.sha256(tensor_digest_prefix(dtype, shape))
    h.update(data)
    return h.hexdigest()


class TensorChanged(ValueError):
    """A tensor's bytes no longer hash to the digest they were read with. ``short``: the
    file now ends before the tensor does."""

    def __init__(self, name: str, short: bool):
        super().__init__(f"tensor {name!r} {'ends early' if short else 'does not match its digest'}")
        self.name, self.short = name, short


def read_tensor_bytes(t, fd: int | None = None) -> bytearray:
    """The stored bytes of tensor ``t`` in a new writable buffer (``torch.frombuffer`` takes it
    without a copy): ``t.data`` for a tensor already in memory, else ``t.nbytes`` bytes at byte
    ``t.offset`` of ``t.path``, read through the open descriptor ``fd`` when one is given.
    Shorter than ``t.nbytes`` when the file ends early; OSError propagates."""
    data = getattr(t, "data", None)
    if data is not None:
        return bytearray(data)
    buf = bytearray(t.nbytes)
    view, done = memoryview(buf), 0
    own = fd is None
    if own:
        fd = os.open(t.path, os.O_RDONLY)
    try:
        while done < t.nbytes:  # one read returns at most about 2 GiB on Linux
            got = os.preadv(fd, [view[done:]], t.offset + done)
            if got <= 0:
                break
            done += got
    finally:
        view.release()
        if own:
            os.close(fd)
    return buf if done == t.nbytes else buf[:done]


def read_verified(t, sha256: str | None, fd: int | None = None) -> bytearray:
    """:func:`read_tensor_bytes`, checked: the bytes must be all there and hash to ``sha256``
    (the tensor digest measured when ``t`` was validated or pinned), else TensorChanged."""
    data = read_tensor_bytes(t, fd)
    if len(data) != t.nbytes:
        raise TensorChanged(t.name, short=True)
    if tensor_sha256(t.dtype, t.shape, data) != sha256:
        raise TensorChanged(t.name, short=False)
    return data


@dataclass(frozen=True)
class TensorScan:
    """Result of streaming one tensor: its digest and, when asked, value facts."""

    sha256: str
    non_finite: int | None = None  # count of NaN/Inf elements (None: not checked)
    all_zero: bool | None = None


def scan_tensor(info: TensorInfo, check_values: bool = False) -> TensorScan:
    """Stream one tensor's bytes from disk in CHUNK_BYTES pieces: digest, and
    with ``check_values`` a NaN/Inf count and an all-zero flag (float dtypes)."""
    h = hashlib.sha256(tensor_digest_prefix(info.dtype, info.shape))
    checker = _ValueCheck(info.dtype, CHUNK_BYTES) if check_values and info.dtype in _FLOAT_BITS else None
    buf = bytearray(min(CHUNK_BYTES, max(info.nbytes, 1)))
    view = memoryview(buf)
    fd = os.open(info.path, os.O_RDONLY)
    try:
        pos, end = info.offset, info.offset + info.nbytes
        while pos < end:
            want = min(len(buf), end - pos)
            got = os.preadv(fd, [view[:want]], pos)
            if got <= 0:
                raise SafetensorsError("E_SAFETENSORS_TRUNCATED", f"tensor {info.name!r} ends early (file changed?)")
            chunk = view[:got]
            h.update(chunk)
            if checker:
                checker.update(chunk)
            pos += got
    finally:
        os.close(fd)
    if checker is None:
        return TensorScan(h.hexdigest())
    return TensorScan(h.hexdigest(), non_finite=checker.non_finite, all_zero=checker.all_zero)


def scan_bytes(data: bytes, dtype: str, shape: tuple[int, ...], check_values: bool = False) -> TensorScan:
    """Same as :func:`scan_tensor` for bytes already in memory (pickle path)."""
    sha256 = tensor_sha256(dtype, shape, data)
    if not (check_values and dtype in _FLOAT_BITS):
        return TensorScan(sha256)
    checker = _ValueCheck(dtype, len(data))
    checker.update(memoryview(data))
    return TensorScan(sha256, non_finite=checker.non_finite, all_zero=checker.all_zero)


class _ValueCheck:
    """Running NaN/Inf count and all-zero flag over raw float chunks, using one
    preallocated scratch buffer (two passes per chunk: mask, max)."""

    def __init__(self, dtype: str, max_chunk_bytes: int):
        self.bits_type, mag, exp = _FLOAT_BITS[dtype]
        self.mag_mask = self.bits_type.type(mag)
        self.exp_mask = exp
        self.scratch = np.empty(max(1, max_chunk_bytes // self.bits_type.itemsize), dtype=self.bits_type)
        self.non_finite = 0
        self.all_zero = True

    def update(self, chunk: memoryview) -> None:
        bits = np.frombuffer(chunk, dtype=self.bits_type)
        if bits.size == 0:
            return
        mag = np.bitwise_and(bits, self.mag_mask, out=self.scratch[: bits.size])
        top = int(mag.max())
        if top >= self.exp_mask:
            self.non_finite += int(np.count_nonzero(mag >= self.exp_mask))
        if top:
            self.all_zero = False


def default_workers() -> int:
    return max(1, os.cpu_count() or 1)


def scan_many(
    tasks: list[tuple[TensorInfo, bool]], workers: int | None = None
) -> list[TensorScan | SafetensorsError]:
    """Scan many tensors on a thread pool (hashlib and pread release the GIL),
    largest first so that one big tensor does not finish last. Returns results
    in task order; a tensor that fails to read yields its SafetensorsError."""
    workers = workers or default_workers()
    order = sorted(range(len(tasks)), key=lambda i: -tasks[i][0].nbytes)
    results: list[TensorScan | SafetensorsError | None] = [None] * len(tasks)

    def run(i: int) -> None:
        info, check = tasks[i]
        try:
            results[i] = scan_tensor(info, check)
        except SafetensorsError as exc:
            results[i] = exc

    if workers == 1 or len(tasks) <= 1:
        for i in order:
            run(i)
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(run, order))
    return results  # type: ignore[return-value]
