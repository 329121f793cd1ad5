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

from collections.abc import Sequence
from dataclasses import dataclass

from mlora.lora_tools.canonical import digest

KEY_SCHEMA = "mlora-kv-block-v1"  # a change of the key's form must change this


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


def block_keys(token_ids: Sequence[int], block_size: int, execution: Execution) -> list[str]:
    """The key of every full block of ``token_ids`` (a trailing partial block has none)."""
    if block_size < 1:
        raise ValueError(f"block size {block_size} must be >= 1")
    keys: list[str] = []
    parent = None
    for end in range(block_size, len(token_ids) + 1, block_size):
        parent = digest({"schema": KEY_SCHEMA, "parent": parent, "execution": execution.of_block(end),
                         "tokens": [int(t) for t in token_ids[end - block_size:end]]})
        keys.append(parent)
    return keys


def shared_blocks(a: Sequence[str], b: Sequence[str]) -> int:
    """How many leading blocks two rows' key chains share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
