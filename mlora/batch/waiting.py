"""The engine's queue of waiting rows, with the number of waiting rows per adapter.

Admission and prefetch ask, every iteration, how many waiting rows name each
adapter (``Engine._slot_plan``) and which adapters the queue still needs
(eviction's hint). Counting that from the rows each time costs time in
proportion to the queue (an 8,192-row scheduling window: several ms of the
engine thread per iteration, on the critical path between two launches); this
queue keeps the counts as rows enter and leave, so those questions cost time
in proportion to the distinct adapters instead.
"""

from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator


class WaitingQueue:
    """Rows (``Sequence``) in queue order: arrivals at the back, preempted rows at the
    front. ``counts[a]`` is the number of queued rows whose ``req.adapter`` is ``a``
    (no entry for ``None``: base rows are ``base_rows``); an adapter with no queued
    row has no entry."""

    def __init__(self) -> None:
        self._rows: deque = deque()
        self.counts: Counter = Counter()
        self.base_rows = 0

    def _enter(self, seq) -> None:
        a = seq.req.adapter
        if a is None:
            self.base_rows += 1
        else:
            self.counts[a] += 1

    def _leave(self, seq) -> None:
        a = seq.req.adapter
        if a is None:
            self.base_rows -= 1
            return
        n = self.counts[a] - 1
        if n:
            self.counts[a] = n
        else:
            del self.counts[a]

    def append(self, seq) -> None:
        self._rows.append(seq)
        self._enter(seq)

    def appendleft(self, seq) -> None:
        self._rows.appendleft(seq)
        self._enter(seq)

    def popleft(self):
        seq = self._rows.popleft()
        self._leave(seq)
        return seq

    def remove_ids(self, gone: set[int]) -> None:
        """Drop the rows whose ``id()`` is in ``gone`` (the order of the others is kept)."""
        if not gone:
            return
        keep = deque()
        for seq in self._rows:
            if id(seq) in gone:
                self._leave(seq)
            else:
                keep.append(seq)
        self._rows = keep

    def take_if(self, pred: Callable) -> list:
        """Remove and return (in queue order) the rows for which ``pred(seq)`` holds."""
        out = [s for s in self._rows if pred(s)]
        self.remove_ids({id(s) for s in out})
        return out

    def adapters(self) -> Iterable[str]:
        """The adapters at least one queued row names."""
        return self.counts.keys()

    def __iter__(self) -> Iterator:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __bool__(self) -> bool:
        return bool(self._rows)
