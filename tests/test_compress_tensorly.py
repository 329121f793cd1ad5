"""``mlora.bench.compress_tensorly`` at a tiny size: mlora's solvers against TensorLy on the same collection."""

import json
import os

import pytest

pytest.importorskip("tensorly")

from conftest import REPO

from mlora.bench import compress_tensorly as bench

TINY = {"dim": 32, "rank": 2, "R": 8, "shared": 8, "noise": 0.1, "dtype": "float64"}


def pair(method, **options):
    kw = {**TINY, **options}
    return bench.run_case("mlora", method, 8, **kw), bench.run_case("tensorly", method, 8, **kw)


@pytest.mark.parametrize("method", ["jd-full", "jd-diag"])
@pytest.mark.parametrize("iters, tol", [(10, 1e-6), (200, 1e-12)])
def test_the_solvers_equal_tensorly(method, iters, tol):
    # JD-Full and partial Tucker are Tucker-2 HOOI from the HOSVD start, U before V; JD-Diag and
    # PARAFAC are ALS from the HOSVD bases, the adapter mode (the cores) first, then U, V (mlora's
    # cores one step ahead after each sweep): the same iterates in exact arithmetic, so the same
    # error up to round-off and the stopping rules.
    ours, theirs = pair(method, iters=iters, tol=tol)
    assert ours["err_mean"] <= theirs["err_mean"] * (1 + 1e-6)
    assert ours["err_mean"] == pytest.approx(theirs["err_mean"], rel=1e-6)
    assert ours["err_max"] == pytest.approx(theirs["err_max"], rel=1e-6)
    assert ours["err_mean"] < 0.05  # the noise floor of this collection, not a failed fit


def test_collection_is_reproducible_and_dense_size_counted():
    a = bench.collection(4, 16, 2, 4, 0.1, bench.DTYPES["float32"], seed=3)
    b = bench.collection(4, 16, 2, 4, 0.1, bench.DTYPES["float32"], seed=3)
    assert all((x.A == y.A).all() and (x.B == y.B).all() for x, y in zip(a, b))
    assert bench.dense_bytes(1024, 4096, bench.DTYPES["float32"]) == 64 * 2**30


def test_tensorly_case_that_cannot_fit_is_skipped(monkeypatch):
    monkeypatch.setattr(bench, "available_bytes", lambda: 1024)
    row = bench.measure("tensorly", "jd-full", 8, **{**TINY, "iters": 2, "tol": 1e-6, "seed": 0})
    assert "skipped" in row and "seconds" not in row


def test_command_line_json(capsys, monkeypatch):
    # the workers are fresh interpreters: they must import this checkout
    monkeypatch.setenv("PYTHONPATH", REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = ["--adapters", "8", "--dim", "32", "--rank", "2", "--shared-rank", "4", "--shared", "4",
            "--dtypes", "float64", "--methods", "jd-full", "--json"]
    assert bench.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["impl"]: r for r in report["rows"]}
    assert set(rows) == {"mlora", "tensorly"}
    assert rows["mlora"]["err_mean"] == pytest.approx(rows["tensorly"]["err_mean"], rel=1e-6)
    assert rows["tensorly"]["dense_mib"] == 8 * 32 * 32 * 8 / 2**20
    assert report["meta"]["cpu"]
