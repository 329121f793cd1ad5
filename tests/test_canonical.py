"""The three byte forms of mlora.lora_tools.canonical and the digests stored over them.

Each form is pinned by its exact bytes and a digest: release.json, bundle.json, output
rows and job fingerprints store digests over these forms, so a form that changed would
make every stored artifact fail its own verification.
"""

import hashlib

import pytest

from mlora.lora_tools.canonical import (
    CanonicalError,
    canonical_json,
    digest,
    document_digest,
    document_json,
    file_sha256,
    sealed_digest,
    spaced_digest,
)

NAME = "r\u00ebv\u00e9rse-\u03bb"  # non-ASCII: the forms differ in how they write it


def test_identity_form_is_compact_utf8_and_refuses_floats():
    value = {"name": NAME, "n": [1, 2, None, True], "z": {"b": 1, "a": "x"}}
    assert canonical_json(value) == '{"n":[1,2,null,true],"name":"rëvérse-λ","z":{"a":"x","b":1}}'.encode()
    assert digest(value) == "8eea107cdc0dc3cf9cad267416afeebb8f6e7f2c7fc3b5a13eadef63e611119e"
    with pytest.raises(CanonicalError, match="float at"):
        canonical_json({"weight": 0.5})


def test_document_form_escapes_non_ascii_and_writes_floats_as_repr():
    doc = {"name": NAME, "weight": 0.5, "tol": 1e-06, "n": [1, 2, None, True], "z": {"b": 1, "a": "x"}}
    assert document_json(doc) == (b'{"n":[1,2,null,true],"name":"r\\u00ebv\\u00e9rse-\\u03bb","tol":1e-06,'
                                  b'"weight":0.5,"z":{"a":"x","b":1}}')
    assert document_digest(doc) == "1d6b6292a927dcecdb7ac39bc0cb871501db702e8090e3efa2adcf0d1d2f4929"
    assert document_json({"x": float("nan"), "y": float("-inf")}) == b'{"x":NaN,"y":-Infinity}'


def test_sealed_digest_covers_every_field_but_its_own():
    doc = {"kind": "merge", "weight": 1.25, "release_sha256": "stale"}
    sealed = sealed_digest(doc, "release_sha256")
    assert sealed == document_digest({"kind": "merge", "weight": 1.25})
    assert sealed_digest(dict(doc, release_sha256=sealed), "release_sha256") == sealed
    assert sealed_digest(dict(doc, weight=1.5), "release_sha256") != sealed


def test_spaced_form_is_the_bundle_member_identity():
    member = {"kind": "mlora-bundle-member", "bundle_sha256": "ab" * 32, "member": NAME, "base_sha256": "cd" * 32}
    text = (f'{{"base_sha256": "{"cd" * 32}", "bundle_sha256": "{"ab" * 32}", "kind": "mlora-bundle-member", '
            '"member": "r\\u00ebv\\u00e9rse-\\u03bb"}')
    assert spaced_digest(member) == hashlib.sha256(text.encode()).hexdigest()
    assert spaced_digest(member) == "3336ce3242902c218fc462bd66d506ea213294545225ffc80ab34c6c3b6d0abb"
    assert spaced_digest(member) != document_digest(member)


def test_file_sha256_streams_the_whole_file(tmp_path):
    data = bytes(range(256)) * 5000
    (tmp_path / "f").write_bytes(data)
    assert file_sha256(str(tmp_path / "f"), chunk_bytes=4096) == hashlib.sha256(data).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert file_sha256(str(tmp_path / "empty")) == hashlib.sha256(b"").hexdigest()
