"""Prefix identity: when two rows' KV blocks are the same, and where an aLoRA adapter starts.

Owns two pure rules the prefix cache is built on (docs/design.md, Prefix identity):

* :func:`alora_activation_start`: the first position an activated LoRA (aLoRA)
  adapter applies to, as PEFT derives it: the start of the *last* exact
  occurrence of the adapter's invocation token ids in the tokenized prompt
  (the first invocation token is adapted); None when the prompt never holds it.
* :func:`block_keys`: the content address of each full KV block of a row. A
  block's key hashes its execution identity, its token ids and its parent
  block's key, so a key names the whole prefix up to the block's end. The
  execution identity of a block is the base's for a base row; for an ordinary
  LoRA row the adapter's from position 0 (an adapter on any module of an
  earlier layer changes every later layer's KV); for an aLoRA row the base's
  for a block that ends at or before the activation start (the KV there equals
  the base model's) and the adapter's (with its activation start) from the
  block that holds it on. Slots, generations and block numbers never enter a
  key: they own memory, they do not change what the KV holds.

Knows no tensors and no engine: plain ints and strings in, hex digests out.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from mlora.lora_tools.canonical import digest

KEY_SCHEMA = "mlora-kv-block-v2"  # a change of the key's form must change this
_ROOT = "0" * 64  # the parent of a row's first block
_LITTLE = array("q", [1]).tobytes()[0] == 1


def alora_activation_start(prompt_ids: Sequence[int], invocation_ids: Sequence[int]) -> int | None:
    """The start of the last exact occurrence of ``invocation_ids`` in ``prompt_ids``, or None.

    Positions from the start on (and every generated token) run with the adapter, those
    before it with the base. An empty invocation sequence is refused: it would match
    everywhere and make the adapter an ordinary LoRA by accident."""
    inv = list(invocation_ids)
    if not inv:
        raise ValueError("an aLoRA adapter needs at least one invocation token id")
    ids = list(prompt_ids)
    for start in range(len(ids) - len(inv), -1, -1):
        if ids[start:start + len(inv)] == inv:
            return start
    return None


@dataclass(frozen=True)
class Execution:
    """What computes a row's KV: the base identity and, for an adapter row, the adapter's
    semantic identity and (aLoRA) the position it starts at."""

    base_sha256: str
    adapter_sha256: str | None = None  # None: the base model alone
    activation_start: int | None = None  # aLoRA: first adapted position; None: adapted from 0

    def __post_init__(self):
        if self.adapter_sha256 is None and self.activation_start is not None:
            raise ValueError("an activation start needs an adapter")
        if self.activation_start is not None and self.activation_start < 0:
            raise ValueError(f"activation start {self.activation_start} is negative")

    def of_block(self, end: int) -> dict:
        """The execution identity of a block covering positions before ``end``."""
        if self.adapter_sha256 is None or (self.activation_start is not None and end <= self.activation_start):
            return {"base": self.base_sha256}
        return {"base": self.base_sha256, "adapter": self.adapter_sha256, "activation": self.activation_start}

    @cached_property
    def _prefixes(self) -> tuple[bytes, bytes]:
        """The hashed head of a key under the base identity and under this execution's own."""
        def head(identity: dict) -> bytes:
            return f"{KEY_SCHEMA}\n{digest(identity)}\n".encode("ascii")

        own = {"base": self.base_sha256, "adapter": self.adapter_sha256, "activation": self.activation_start}
        return head({"base": self.base_sha256}), head(own) if self.adapter_sha256 is not None else b""

    def head(self, end: int) -> bytes:
        """:meth:`of_block`'s identity of a block ending at ``end``, as the key's hashed head."""
        base, own = self._prefixes
        return base if self.adapter_sha256 is None or (
            self.activation_start is not None and end <= self.activation_start) else own


def block_key(parent: str | None, tokens: Sequence[int], head: bytes) -> str:
    """The key of one full block: its execution head, its parent's key and its token ids
    (signed 64-bit, little-endian), hashed with SHA-256."""
    h = hashlib.sha256(head)
    h.update((parent or _ROOT).encode("ascii"))
    ids = array("q", tokens)
    if not _LITTLE:
        ids.byteswap()
    h.update(ids.tobytes())
    return h.hexdigest()


def extend_block_keys(keys: list[str], token_ids: Sequence[int], block_size: int, execution: Execution) -> list[str]:
    """``keys`` (the keys of the leading full blocks of ``token_ids``, maybe none) with the key of
    every further full block appended, in place; a trailing partial block has none."""
    if block_size < 1:
        raise ValueError(f"block size {block_size} must be >= 1")
    for end in range((len(keys) + 1) * block_size, len(token_ids) + 1, block_size):
        keys.append(block_key(keys[-1] if keys else None, token_ids[end - block_size:end], execution.head(end)))
    return keys


def block_keys(token_ids: Sequence[int], block_size: int, execution: Execution) -> list[str]:
    """The key of every full block of ``token_ids`` (a trailing partial block has none)."""
    return extend_block_keys([], token_ids, block_size, execution)


def shared_blocks(a: Sequence[str], b: Sequence[str]) -> int:
    """How many leading blocks two rows' key chains share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
