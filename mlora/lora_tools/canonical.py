"""Canonical serialisation and SHA-256 helpers for every mlora identity (spec 0x01G).

Owns the byte form that digests are computed over. Must not know what an
adapter or a base is: callers build plain values, this module serialises them.

Canonical form (docs/identity.md has the full contract):

* JSON, UTF-8, object keys sorted, separators ``,`` and ``:``, no whitespace,
  non-ASCII characters written as themselves (``ensure_ascii=False``).
* Allowed values: ``null``, booleans, integers, strings, lists, objects with
  string keys. Floats are refused: callers encode a real number with
  :func:`canonical_real` (an explicit decimal string), so that ``16`` and
  ``16.0`` cannot silently hash differently and other implementations need no
  float formatting rules.
* No paths or pointers: nothing here checks that, the record builders do.
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
    """The canonical bytes of ``value`` (see the module docstring)."""
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
    return hashlib.sha256(data).hexdigest()


def digest(value: Any) -> str:
    """SHA-256 (hex) of the canonical form of ``value``."""
    return sha256_hex(canonical_json(value))


def canonicalize_floats(value: Any) -> Any:
    """Copy of a JSON value with every float replaced by ``{"real": canonical_real(x)}``.

    Used for documents we do not own (``config.json``), where a float may sit
    anywhere; the tagged object keeps floats distinct from strings."""
    if isinstance(value, float):
        return {"real": canonical_real(value)}
    if isinstance(value, dict):
        return {k: canonicalize_floats(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonicalize_floats(v) for v in value]
    return value
