"""The engine's waiting queue keeps its per-adapter counts equal to its rows."""

import random
from collections import Counter
from types import SimpleNamespace

from mlora.batch.engine.waiting import WaitingQueue


def _row(adapter, arrival=0):
    return SimpleNamespace(adapter=adapter, arrival=arrival)


def _check(q: WaitingQueue, rows: list):
    assert list(q) == rows and len(q) == len(rows) and bool(q) == bool(rows)
    want = Counter(r.adapter for r in rows if r.adapter is not None)
    assert q.counts == want and set(q.adapters()) == set(want)
    assert all(n > 0 for n in q.counts.values())  # an adapter with no row has no entry
    assert q.base_rows == sum(r.adapter is None for r in rows)
    for a in {None, *want}:  # each adapter's rows, in queue order, any prefix
        mine = [r for r in rows if r.adapter == a]
        assert q.rows_of(a, len(rows) + 1) == mine and q.rows_of(a, 2) == mine[:2]
    assert [q.position(r) for r in rows] == sorted(q.position(r) for r in rows)
    if rows:
        assert q.min_arrival() == min(r.arrival for r in rows)


def test_counts_follow_every_operation_on_random_sequences():
    rng = random.Random(5)
    q, rows = WaitingQueue(), []
    out: list = []  # rows that left: some come back (a preempted row re-enters at the front)
    for step in range(3000):
        op = rng.randrange(6)
        if op == 0 or not rows:
            r = _row(rng.choice([None, "a", "b", "c", "d"]), arrival=step)
            q.append(r)
            rows.append(r)
        elif op == 1:
            r = _row(rng.choice([None, "a", "e"]), arrival=rng.randrange(step + 1))
            q.appendleft(r)
            rows.insert(0, r)
        elif op == 5 and out:
            r = out.pop(rng.randrange(len(out)))
            q.appendleft(r)  # the same object again: its old entries must stay dead
            rows.insert(0, r)
        elif op == 2:
            r = rows.pop(0)
            assert q.popleft() is r
            out.append(r)
        elif op == 3:
            gone = rng.sample(rows, min(len(rows), rng.randrange(40)))
            q.discard(gone + gone[:1])  # a row named twice leaves once
            rows = [r for r in rows if all(r is not g for g in gone)]
            out += gone
        else:
            a = rng.choice([None, "a", "b"])
            taken = q.take_if(lambda s: s.adapter == a)
            assert taken == [r for r in rows if r.adapter == a]
            rows = [r for r in rows if r.adapter != a]
            out += taken
        _check(q, rows)
    assert q._dead <= max(64, len(q)) + 40  # dead entries are compacted away, not kept forever


def test_a_row_is_queued_at_most_once_and_empty_questions_fail():
    import pytest

    q = WaitingQueue()
    r = _row("a")
    q.append(r)
    with pytest.raises(ValueError):
        q.appendleft(r)
    assert q.popleft() is r and not q and q.rows_of("a", 5) == []
    with pytest.raises(IndexError):
        q.popleft()
    with pytest.raises(ValueError):
        q.min_arrival()

