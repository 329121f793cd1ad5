"""Adapter-aware assignment of input rows to engine workers (``--gpus`` / ``--num-workers``).

Owns which worker runs which row. Must not know processes, pipes or engines:
the coordinator (``coordinator.py``) asks for chunks and says what came back. Pure
and deterministic, so it is tested alone (tests/test_batch_multi.py).

Goals: each adapter's rows on as few workers as possible, so the job
loads each adapter about once (load amplification near 1), and token load
balanced, so no worker idles while another still has a queue.

Policy: greedy list scheduling over adapter groups, pulled by the workers.

* Queued rows wait in groups, one per adapter (base-model rows form one group),
  in input order, each with an estimated cost in tokens (prompt tokens +
  max_new_tokens).
* A worker with room asks for a chunk: up to ``max_rows`` rows of one group,
  from the first of these that has rows:

    1. the group it took from last (no adapter switch);
    2. another group it owns (its engine ran that adapter already), the one
       whose oldest queued row comes first in the input;
    3. the group with the most estimated tokens that no worker owns; the
       worker becomes its owner (largest first, as in LPT bin packing);
    4. the group with the most estimated tokens among those other workers own,
       taken from its tail (the owner goes on from the head); the worker
       becomes a co-owner.

  Rule 4 is the only place an adapter is split across workers: only when a
  worker would otherwise idle, and the largest groups first. Because workers
  pull work when they have room, tokens balance by measured speed, not by
  trusting the estimates; the coordinator keeps chunks small at the end of the
  input so the last chunks spread over every worker.
* A worker that died: :meth:`Dispatcher.requeue` puts its unfinished rows back
  at the head of their groups and :meth:`Dispatcher.forget` drops it from every
  owner set (a group no live worker owns is free again, rule 3).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class Dispatcher:
    """Queued rows by adapter group, and who owns which group (module docstring)."""

    def __init__(self):
        self._groups: dict[Hashable, deque[tuple[int, int]]] = {}  # adapter -> (row, cost), input order
        self._cost: dict[Hashable, int] = {}  # adapter -> estimated tokens queued
        self.owners: dict[Hashable, set[int]] = {}  # adapter -> workers that ran it (kept when the group empties)
        self._last: dict[int, Hashable] = {}  # worker -> adapter of its last chunk
        self.pending_rows = 0

    def add(self, row: int, adapter: Hashable, cost: int) -> None:
        """Queue ``row`` (rows of one group must be added in input order)."""
        self._groups.setdefault(adapter, deque()).append((row, cost))
        self._cost[adapter] = self._cost.get(adapter, 0) + cost
        self.pending_rows += 1

    def requeue(self, items: list[tuple[int, Hashable, int]]) -> None:
        """Put (row, adapter, cost) back at the head of their groups, in row order."""
        for row, adapter, cost in sorted(items, key=lambda x: x[0], reverse=True):
            self._groups.setdefault(adapter, deque()).appendleft((row, cost))
            self._cost[adapter] = self._cost.get(adapter, 0) + cost
            self.pending_rows += 1

    def forget(self, worker: int) -> None:
        """``worker`` is gone: it owns nothing any more."""
        for owners in self.owners.values():
            owners.discard(worker)
        self._last.pop(worker, None)

    def take(self, worker: int, max_rows: int) -> tuple[Hashable, list[int]] | None:
        """The next chunk for ``worker``: (adapter, rows in input order), or None when nothing is queued."""
        if max_rows < 1 or not self.pending_rows:
            return None
        adapter, from_tail = self._choose(worker)
        q = self._groups[adapter]
        n = min(max_rows, len(q))
        if from_tail:
            taken = [q.pop() for _ in range(n)][::-1]
        else:
            taken = [q.popleft() for _ in range(n)]
        self._cost[adapter] -= sum(c for _, c in taken)
        self.pending_rows -= n
        if not q:
            del self._groups[adapter], self._cost[adapter]
        self.owners.setdefault(adapter, set()).add(worker)
        self._last[worker] = adapter
        return adapter, [r for r, _ in taken]

    def _choose(self, worker: int) -> tuple[Hashable, bool]:
        last = self._last.get(worker, _NONE)
        if last in self._groups:
            return last, False
        owned = [a for a in self._groups if worker in self.owners.get(a, ())]
        if owned:
            return min(owned, key=lambda a: self._groups[a][0][0]), False
        free = [a for a in self._groups if not self.owners.get(a)]
        if free:
            return max(free, key=self._rank), False
        return max(self._groups, key=self._rank), True

    def _rank(self, adapter: Hashable) -> tuple[int, int]:
        """Most estimated tokens first; ties: the group whose oldest row comes first."""
        return self._cost[adapter], -self._groups[adapter][0][0]


_NONE = object()  # "no last group" (None is the base-model group)
