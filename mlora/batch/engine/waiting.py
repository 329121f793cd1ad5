"""The engine's queue of waiting rows, indexed by adapter.

Admission and prefetch ask, every iteration, how many waiting rows name each
adapter (``Scheduler.slot_plan``), which adapters the queue still needs
(eviction's hint), the oldest arrival (the starvation guard), and the first
rows of the adapters a pass may admit. Answering from the rows each time costs
time in proportion to the queue (an 8,192-row scheduling window: several ms
of the engine thread per admitting step, on the critical path between two
launches); this queue keeps the answers as rows enter and leave, so each costs
time in proportion to the distinct adapters or to the rows returned.

Layout: every stint of a row in the queue has a position (arrivals at the back
count up, rows put back at the front count down), so queue order is position
order. One deque per adapter (``None``: base rows) and one global deque hold
(position, row) entries in position order; a heap holds (arrival, position,
row). Removing a row forgets its position: an entry whose position is not its
row's current one is dead, skipped and dropped lazily (the deques are rebuilt
once dead entries outnumber live ones).
"""

import heapq
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator


class WaitingQueue:
    """Rows (``Sequence``: ``adapter`` and ``arrival``) in queue order: arrivals at the
    back, preempted rows at the front. ``counts[a]`` is the number of queued rows whose
    ``adapter`` is ``a`` (no entry for ``None``: base rows are ``base_rows``); an
    adapter with no queued row has no entry. A row is in the queue at most once."""

    def __init__(self) -> None:
        self._rows: deque = deque()  # (position, row), live and dead, in position order
        self._by: dict = {}  # adapter (None: base) -> deque of (position, row) in position order
        self._arrivals: list = []  # heap of (arrival, position, id(row), row)
        self._pos: dict[int, int] = {}  # id(row) -> its position (only rows in the queue)
        self._back, self._front = 0, 0
        self._dead = 0
        self.counts: Counter = Counter()
        self.base_rows = 0

    # ---- entering and leaving ---------------------------------------------------------------

    def append(self, seq) -> None:
        self._back += 1
        self._enter(seq, self._back, left=False)

    def appendleft(self, seq) -> None:
        self._front -= 1
        self._enter(seq, self._front, left=True)

    def popleft(self):
        """Remove and return the first row."""
        while self._rows:
            pos, seq = self._rows.popleft()
            live = self._live(pos, seq)
            if live:
                self._leave(seq)
            self._dead -= 1  # its entry (dead now, or already) left the global deque
            if live:
                return seq
        raise IndexError("pop from an empty WaitingQueue")

    def discard(self, seqs: Iterable) -> None:
        """Remove each of ``seqs`` that is queued (the order of the others is kept)."""
        for seq in seqs:
            if id(seq) in self._pos:
                self._leave(seq)
        if self._dead > 64 and self._dead > len(self._pos):
            self._compact()

    def take_if(self, pred: Callable) -> list:
        """Remove and return (in queue order) the rows for which ``pred(seq)`` holds."""
        out = [s for s in self if pred(s)]
        self.discard(out)
        return out

    # ---- questions --------------------------------------------------------------------------

    def adapters(self) -> Iterable[str]:
        """The adapters at least one queued row names."""
        return self.counts.keys()

    def rows_of(self, adapter, limit: int) -> list:
        """The first ``limit`` queued rows naming ``adapter`` (None: base rows), in queue order."""
        rows = self._by.get(adapter)
        if not rows or limit <= 0:
            return []
        while rows and not self._live(*rows[0]):  # dead entries at the front: drop them for good
            rows.popleft()
        out = []
        for pos, seq in rows:
            if self._live(pos, seq):
                out.append(seq)
                if len(out) >= limit:
                    break
        return out

    def position(self, seq) -> int:
        """``seq``'s place in queue order (smaller: earlier); KeyError if it is not queued."""
        return self._pos[id(seq)]

    def min_arrival(self) -> int:
        """The oldest ``arrival`` among the queued rows; ValueError if the queue is empty."""
        heap = self._arrivals
        while heap and not self._live(heap[0][1], heap[0][3]):
            heapq.heappop(heap)
        if not heap:
            raise ValueError("min_arrival of an empty WaitingQueue")
        return heap[0][0]

    def __iter__(self) -> Iterator:
        return (s for _, s in self._live_entries(self._rows))

    def __len__(self) -> int:
        return len(self._pos)

    def __bool__(self) -> bool:
        return bool(self._pos)

    # ---- internals --------------------------------------------------------------------------

    def _live(self, pos: int, seq) -> bool:
        return self._pos.get(id(seq)) == pos

    def _live_entries(self, entries):
        return ((p, s) for p, s in entries if self._live(p, s))

    def _enter(self, seq, pos: int, left: bool) -> None:
        if id(seq) in self._pos:
            raise ValueError("a row is queued at most once")
        self._pos[id(seq)] = pos
        entry = (pos, seq)
        by = self._by.setdefault(seq.adapter, deque())
        if left:
            self._rows.appendleft(entry)
            by.appendleft(entry)
        else:
            self._rows.append(entry)
            by.append(entry)
        heapq.heappush(self._arrivals, (seq.arrival, pos, id(seq), seq))
        a = seq.adapter
        if a is None:
            self.base_rows += 1
        else:
            self.counts[a] += 1

    def _leave(self, seq) -> None:
        del self._pos[id(seq)]
        self._dead += 1
        a = seq.adapter
        if a is None:
            self.base_rows -= 1
            return
        n = self.counts[a] - 1
        if n:
            self.counts[a] = n
        else:
            del self.counts[a]

    def _compact(self) -> None:
        """Rebuild the deques and the heap from the live entries."""
        self._rows = deque(self._live_entries(self._rows))
        self._by = {}
        for entry in self._rows:
            self._by.setdefault(entry[1].adapter, deque()).append(entry)
        self._arrivals = [(s.arrival, p, id(s), s) for p, s in self._rows]
        heapq.heapify(self._arrivals)
        self._dead = 0
