"""The engine's waiting queue keeps its per-adapter counts equal to its rows."""

import random
from collections import Counter
from types import SimpleNamespace

from mlora.batch.waiting import WaitingQueue


def _row(adapter):
    return SimpleNamespace(req=SimpleNamespace(adapter=adapter))


def _check(q: WaitingQueue, rows: list):
    assert list(q) == rows and len(q) == len(rows) and bool(q) == bool(rows)
    want = Counter(r.req.adapter for r in rows if r.req.adapter is not None)
    assert q.counts == want and set(q.adapters()) == set(want)
    assert all(n > 0 for n in q.counts.values())  # an adapter with no row has no entry
    assert q.base_rows == sum(r.req.adapter is None for r in rows)


def test_counts_follow_every_operation_on_random_sequences():
    rng = random.Random(5)
    q, rows = WaitingQueue(), []
    for _ in range(2000):
        op = rng.randrange(5)
        if op == 0 or not rows:
            r = _row(rng.choice([None, "a", "b", "c", "d"]))
            q.append(r)
            rows.append(r)
        elif op == 1:
            r = _row(rng.choice([None, "a", "e"]))
            q.appendleft(r)
            rows.insert(0, r)
        elif op == 2:
            assert q.popleft() is rows.pop(0)
        elif op == 3:
            gone = {id(r) for r in rng.sample(rows, min(len(rows), rng.randrange(4)))}
            q.remove_ids(gone)
            rows = [r for r in rows if id(r) not in gone]
        else:
            a = rng.choice([None, "a", "b"])
            taken = q.take_if(lambda s: s.req.adapter == a)
            assert taken == [r for r in rows if r.req.adapter == a]
            rows = [r for r in rows if r.req.adapter != a]
        _check(q, rows)
