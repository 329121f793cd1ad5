"""The scheduler's side of the prefix cache: which blocks a row takes, computes and publishes.

Owns per-row prefix state (docs/batch.md, Prefix cache): a queued row's
execution identity and block keys (``model/prefix.py``), the chain of cached
blocks it takes at admission (``model/prefixcache.py``), the blocks running
rows are computing now (a row whose next block one of them computes waits to
share it instead of computing it too), the publication of each block a row
fills, and the first-block groups admission orders rows by. Must not choose
rows: the scheduler asks, then decides.
"""

from __future__ import annotations

from mlora.batch.engine.sequence import Sequence
from mlora.batch.model.prefix import Execution, extend_block_keys
from mlora.batch.model.prefixcache import PrefixCache

BASE_EXECUTION = "base"  # the base part of a block key: an engine serves one base, its cache is its own


class PrefixSharing:
    """Rows over ``cache`` (the engine's block allocator), blocks of ``block_size`` tokens;
    ``pinned``: the job's adapters (their semantic identities enter the keys)."""

    def __init__(self, cache: PrefixCache, block_size: int, pinned: dict):
        self.cache, self.block_size, self.pinned = cache, block_size, pinned
        self._computing: dict[str, Sequence] = {}  # key -> the running row that computes that block now
        self._groups: dict[str, list[int]] = {}  # first-block key -> [its rank, rows not yet admitted]
        self._group_count = 0

    def enter(self, seq: Sequence) -> None:
        """A new row: its execution identity, its blocks' keys and its first-block group
        (rows whose first block is the same share a rank: that of the group's first row)."""
        sha = self.pinned[seq.adapter].semantic_sha256 if seq.adapter is not None else None
        seq.execution = Execution(BASE_EXECUTION, sha, seq.active_from if seq.active_from else None)
        extend_block_keys(seq.keys, seq.tokens, self.block_size, seq.execution)
        group = self._groups.get(seq.keys[0]) if seq.keys else None
        if group is None:
            self._group_count += 1
            group = [self._group_count, 0]
            if seq.keys:
                self._groups[seq.keys[0]] = group
        group[1] += 1
        seq.group = group[0]

    def leave_group(self, seq: Sequence) -> None:
        """A row admitted for the first time: one row fewer waits in its group."""
        group = self._groups.get(seq.keys[0]) if seq.keys else None
        if group is not None and group[0] == seq.group:
            group[1] -= 1
            if group[1] == 0:
                del self._groups[seq.keys[0]]

    def match(self, seq: Sequence) -> bool:
        """Give a row that holds no block the longest chain of cached blocks of its tokens (at
        least one token is left to compute: its logits). False, nothing taken, when the first
        block it would compute is being computed by a running row: it then waits to share it."""
        limit = (len(seq.tokens) - 1) // self.block_size
        keys = seq.keys[:limit]
        run = self.cache.cached_run(keys)
        if run < limit and self._computing.get(keys[run], seq) is not seq:
            return False
        seq.blocks = self.cache.match(keys)
        seq.published = len(seq.blocks)
        seq.num_computed = seq.published * self.block_size
        return True

    def unmatch(self, seq: Sequence) -> None:
        """Give back the chain :meth:`match` took for a row that could not be seated."""
        if seq.blocks:
            self.cache.unmatch(seq.blocks, (len(seq.tokens) - 1) // self.block_size)
            seq.blocks, seq.published, seq.num_computed = [], 0, 0

    def seated(self, seq: Sequence) -> None:
        """A row admitted: the full blocks it is to compute are its own to compute."""
        for key in seq.keys[seq.published:len(seq.tokens) // self.block_size]:
            self._computing.setdefault(key, seq)

    def publish(self, seq: Sequence) -> None:
        """Enter the row's newly computed full blocks into the cache (read-only from now on; a
        block whose key another row published first stays the row's own)."""
        done = seq.num_computed // self.block_size
        if done <= seq.published:
            return
        extend_block_keys(seq.keys, seq.tokens, self.block_size, seq.execution)
        for i in range(seq.published, done):
            key = seq.keys[i]
            self.cache.publish(key, seq.blocks[i])
            if self._computing.get(key) is seq:
                del self._computing[key]
        seq.published = done

    def forget(self, seq: Sequence) -> None:
        """A row leaving the running set (its blocks about to be freed): the blocks it was to
        compute are free for another row to compute."""
        for key in seq.keys[seq.published:]:
            if self._computing.get(key) is seq:
                del self._computing[key]
        seq.published = 0
