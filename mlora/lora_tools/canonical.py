"""The byte forms every mlora digest is computed over, and the SHA-256 helpers.

Owns the serialisation that digests hash. Must not know what an adapter, a
base, a release or a bundle is: callers build plain values, this module turns
them into bytes. Every stored digest is computed over exactly one of the three
forms below, and a form never changes, so a digest written once verifies for
ever (docs/identity.md has the identity contract).

**Identity form** (:func:`canonical_json`, :func:`digest`): adapter and base
identities, tensor digest prefixes, job fingerprints.

* JSON, UTF-8, object keys sorted, separators ``,`` and ``:``, no whitespace,
  non-ASCII characters written as themselves (``ensure_ascii=False``).
* Allowed values: ``null``, booleans, integers, strings, lists, objects with
  string keys. Floats are refused: callers encode a real number with
  :func:`canonical_real` (an explicit decimal string), so that ``16`` and
  ``16.0`` cannot silently hash differently and other implementations need no
  float formatting rules.
* No paths or pointers: nothing here checks that, the record builders do.

**Document form** (:func:`document_json`, :func:`document_digest`,
:func:`sealed_digest`): the self-digest of a document mlora writes and reads
back, ``release_sha256`` of release.json and ``bundle_sha256`` of bundle.json.
These documents carry measured reals (merge weights, fit errors, tolerances),
so floats are allowed. Keys sorted, separators ``,`` and ``:``, every
non-ASCII character escaped as ``\\uXXXX`` (the text is pure ASCII), a float
written as Python's shortest round-trip ``repr``, non-finite floats as
``NaN`` / ``Infinity`` / ``-Infinity``.

**Spaced form** (:func:`spaced_digest`): the document form with separators
``", "`` and ``": "``; the semantic identity of a bundle member, which output
rows and job fingerprints store.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any


class CanonicalError(TypeError):
    """A value that has no canonical form (a float, a non-string key, an object)."""


def _check(value: Any, where: str) -> None:
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        raise CanonicalError(f"float at {where}: encode it with canonical_real()")
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CanonicalError(f"non-string key {key!r} at {where}")
            _check(item, f"{where}.{key}")
        return
    raise CanonicalError(f"{type(value).__name__} at {where} has no canonical form")


def canonical_json(value: Any) -> bytes:
    """The identity form of ``value`` (see the module docstring)."""
    _check(value, "$")
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def canonical_real(x: float | int) -> str:
    """An exact decimal string for a real number: Python's shortest round-trip
    ``repr`` of the IEEE-754 binary64 value (``16`` -> ``"16.0"``,
    ``1e-05`` -> ``"1e-05"``, non-finite -> ``"nan"``, ``"inf"``, ``"-inf"``)."""
    if isinstance(x, bool):
        raise CanonicalError("a boolean is not a real number")
    f = float(x)
    if math.isnan(f):
        return "nan"
    return repr(f)


def sha256_hex(data: bytes) -> str:
    """SHA-256 (hex) of ``data`` (any bytes-like object)."""
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str, chunk_bytes: int = 1 << 20) -> str:
    """SHA-256 (hex) of a whole file's bytes, read in ``chunk_bytes`` pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(chunk_bytes), b""):
            h.update(chunk)
    return h.hexdigest()


def digest(value: Any) -> str:
    """SHA-256 (hex) of the identity form of ``value``."""
    return sha256_hex(canonical_json(value))


def document_json(value: Any) -> bytes:
    """The document form of ``value`` (see the module docstring)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def document_digest(value: Any) -> str:
    """SHA-256 (hex) of the document form of ``value``."""
    return sha256_hex(document_json(value))


def sealed_digest(document: dict, key: str) -> str:
    """The self-digest of ``document``: the document digest of every field but ``key``,
    the field that stores it (``release_sha256``, ``bundle_sha256``)."""
    return document_digest({k: v for k, v in document.items() if k != key})


def spaced_digest(value: Any) -> str:
    """SHA-256 (hex) of the spaced form of ``value`` (see the module docstring)."""
    return sha256_hex(json.dumps(value, sort_keys=True).encode("ascii"))


def canonicalize_floats(value: Any) -> Any:
    """Copy of a JSON value with every float replaced by ``{"real": canonical_real(x)}``.

    Used for documents mlora does not own (``config.json``), where a float may sit
    anywhere; the tagged object keeps floats distinct from strings."""
    if isinstance(value, float):
        return {"real": canonical_real(value)}
    if isinstance(value, dict):
        return {k: canonicalize_floats(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonicalize_floats(v) for v in value]
    return value

