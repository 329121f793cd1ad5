"""Fast load validation: per-view statistics compared on the device against the host image."""

import pytest
import torch

import mlora.batch.adapters.residency.storage as storage_mod
from mlora.batch.adapters.residency.errors import ValidationError
from mlora.batch.adapters.residency.host import HostArtifact, Piece, view_stats
from mlora.batch.adapters.residency.storage import SlotStorage, validate_landed


def test_view_stats_depend_on_the_bytes_not_the_layout():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(6, 10, generator=g).to(torch.bfloat16)
    assert torch.equal(view_stats(t.t().contiguous().t()), view_stats(t))  # non-contiguous copy, same values
    s = view_stats(t).tolist()
    assert s[0] == 0 and s[1] == int(torch.count_nonzero(t))
    u = t.clone()
    u[2, 3] = -u[2, 3]
    assert view_stats(u).tolist()[2:] != s[2:]  # one word changed
    w = t.clone().reshape(-1)
    w[[4, 9]] = w[[9, 4]]
    assert view_stats(w.reshape(6, 10)).tolist()[3] != s[3]  # two words swapped: the weighted sum sees it
    nan = t.clone()
    nan[0, 0] = float("nan")
    nan[1, 1] = float("-inf")
    assert view_stats(nan).tolist()[0] == 2  # the non-finite values, counted
    assert view_stats(torch.tensor([[3, 0], [0, 7]], dtype=torch.int32)).tolist()[:2] == [0, 2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.uint8])
def test_host_and_device_view_stats_agree(dtype):
    """The numpy host path and the torch device path compute the same four integers
    (here both on the CPU), incl. NaN, inf, -0.0 and an odd number of bytes."""
    from mlora.batch.adapters.residency.host import _view_stats_host, _view_stats_torch

    g = torch.Generator().manual_seed(3)
    n = 4099 if dtype == torch.uint8 else 3001  # odd byte count for uint8
    if dtype.is_floating_point:
        t = (torch.randn(n, generator=g) * 1e3).to(dtype)
        t[::7] = 0.0
        t[5] = -0.0
    else:
        t = torch.randint(0, 200, (n,), generator=g).to(dtype)
        t[::5] = 0
    for poison in (None, float("nan"), float("inf")):
        u = t.clone()
        if poison is not None:
            if not dtype.is_floating_point:
                continue
            u[17] = poison
        host, dev = _view_stats_host(u).tolist(), _view_stats_torch(u).tolist()
        assert host == dev
        assert host[0] == (1 if poison is not None else 0)
        assert host[1] == int(torch.count_nonzero(u))  # -0.0 counts as zero, NaN as non-zero


def _slot(dtype=torch.float32):
    A = torch.zeros(3, 2, 4, 5, dtype=dtype)  # 3 slots of [2, 4, 5]
    ranks = torch.zeros(3, 2, dtype=torch.int32)
    return SlotStorage({"A": (A, 0), "ranks": (ranks, 0)}), A, ranks


def _artifact():
    g = torch.Generator().manual_seed(1)
    return HostArtifact("k", "k", [Piece("A", (0, slice(0, 2)), torch.randn(2, 5, generator=g) + 3),
                                   Piece("A", (1, slice(0, 3)), torch.randn(3, 5, generator=g) - 3),
                                   Piece("ranks", (), torch.tensor([2, 3], dtype=torch.int32))])


def _land(storage, art, slot=1):
    views = storage.views(slot, [])
    for p in art.pieces:
        views[p.view][p.index].copy_(p.src)
    return views


def test_a_correct_load_is_accepted_without_reading_it_back(monkeypatch):
    storage, _, _ = _slot()
    art = _artifact()
    views = _land(storage, art)

    def no_readback(*a, **k):
        raise AssertionError("the fast path must not re-hash the landed bytes")

    monkeypatch.setattr(storage_mod, "pieces_sha256", no_readback)
    validate_landed(storage, views, art)
    assert art.image_sha256 == ""  # the exact reference was never needed


@pytest.mark.parametrize("poke, code", [
    (lambda v: v["A"][0, 3].fill_(1.0), "E_VALIDATE_TAIL"),  # stale values in a padded rank row
    (lambda v: v["A"][0, 1, 2].mul_(2.0), "E_VALIDATE_DIGEST"),  # a landed factor value changed
    (lambda v: v["A"][1, 0, 0].fill_(0.0), "E_VALIDATE_DIGEST"),  # part of the copy missing
    (lambda v: v["A"][0, 0, 0].fill_(float("nan")), "E_VALIDATE_NONFINITE"),
])
def test_a_wrong_load_fails_with_the_exact_code(poke, code):
    storage, _, _ = _slot()
    art = _artifact()
    views = _land(storage, art)
    poke(views)
    with pytest.raises(ValidationError) as e:
        validate_landed(storage, views, art)
    assert e.value.code == code


def test_view_stats_of_a_strided_one_element_column():
    t = torch.arange(12, dtype=torch.int32).reshape(4, 3)[:, :1]  # "contiguous" by shape, stride 3
    assert view_stats(t).tolist()[:3] == [0, 3, 0 + 3 + 6 + 9]
    assert view_stats(t[:1]).tolist()[:3] == [0, 0, 0]


def test_word_partials_rows_do_not_depend_on_how_chunks_are_launched(monkeypatch):
    """wordstats.PROGRAMS / UNROLL (fewer programs walking several chunks, several blocks loaded
    per step) change only the launch: the rows of partials are the same numbers, and each
    view's sum equals the host reference. Two views of 3 and 2 chunks, neither a whole number
    of chunks or of unrolled steps; a NaN in the second."""
    from mlora.batch.adapters.residency import host as host_mod
    from mlora.kernels import wordstats

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    a = (torch.randn(70001, generator=g) * 2).to(torch.bfloat16)
    b = (torch.randn(40003, generator=g) * 2).to(torch.bfloat16)
    b[39000] = float("nan")
    exp, mag = 0x7F80, 0x7FFF
    words = [t.to(dev).view(torch.int16) for t in (a, b)]
    want = [host_mod._view_stats_host(t).tolist() for t in (a, b)]
    rows = []
    for programs, unroll in ((None, 1), (2, 1), (1, 4), (3, 2), (64, 8)):
        monkeypatch.setattr(wordstats, "PROGRAMS", programs)
        monkeypatch.setattr(wordstats, "UNROLL", unroll)
        got = wordstats.word_partials(words, exp, mag, host_mod.CHECK_MODULUS).cpu()
        assert got.shape == (5, 4)  # a row per chunk: a chunk not walked leaves its row unwritten
        assert wordstats.split_sums(got, [a.numel(), b.numel()]) == want, (programs, unroll)
        rows.append(got)
    assert all(torch.equal(r, rows[0]) for r in rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_word_stats_equal_the_reference(dtype):
    """host._view_stats_fused (the one-pass Triton kernel large 16-bit views take on a GPU; here
    under the interpreter) gives exactly the numbers of the host reference: lengths around
    the block size and past the 65521-word weight period, zeros of both signs, a NaN or an
    infinity, every word's position weighted."""
    from mlora.batch.adapters.residency import host as host_mod

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU machine: compiled, not interpreted

    def fused(t):
        return host_mod._view_stats_fused(t.to(dev)).cpu()

    g = torch.Generator().manual_seed(11)
    for n in (1, 4095, 4097, 70001):
        x = (torch.randn(n, generator=g) * 3).to(dtype)
        if n > 8:
            x[3], x[5] = 0.0, -0.0
        want = host_mod._view_stats_host(x)
        assert torch.equal(fused(x.clone()), want)
        if n > 8:
            for bad in (float("nan"), float("inf")):
                y = x.clone()
                y[7] = bad
                got = fused(y)
                assert got[0] == 1 and torch.equal(got, host_mod._view_stats_host(y))
        y = x.clone()
        y[n // 2] = -y[n // 2] if y[n // 2] != 0 else 1.0  # one word changed: the sums move
        assert not torch.equal(fused(y), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_stats_parts_equal_view_stats(dtype):
    """host.view_stats_parts (what a load's probe issues: on a GPU one word-stats launch per two
    16-bit views, each program writing its own row of partials; here forced through the
    interpreter) gives every view's view_stats once its rows are summed: an odd number of
    views (a launch with one view), sizes crossing one program's 32K words and the 65521-word
    weight period, non-finite values counted. The output rows are never zeroed, so every
    row must be written: unwritten garbage would change the sums."""
    from mlora.batch.adapters.residency.host import view_stats, view_stats_parts

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    views = [(torch.randn(n, generator=g) * 2).to(dtype) for n in (1, 4097, 32768 + 5, 70001, 65537)]
    views[2][9] = float("nan")
    views[3][70000] = float("-inf")
    views[3][3] = float("inf")
    named = {f"v{i}": v.to(dev) for i, v in enumerate(views)}
    sixteen = dtype in (torch.bfloat16, torch.float16)
    for fused in ([True, None] if sixteen else [None]):
        parts = view_stats_parts(named, fused=fused)
        if fused:
            assert [p.names for p in parts] == [["v0", "v1"], ["v2", "v3"], ["v4"]]  # two views per launch
            assert all(p.counts is not None for p in parts)
        got = {}
        for p in parts:
            got.update(p.to("cpu").stats())
        assert got == {n: view_stats(v).tolist() for n, v in zip(named, views)}
        assert got["v2"][0] == 1 and got["v3"][0] == 2 and got["v0"][0] == 0


def test_a_kernel_that_cannot_run_falls_back_to_the_same_numbers(monkeypatch):
    """If the word-stats kernel fails (e.g. it does not compile on some GPU), validation
    computes the same numbers with torch reductions, says so once, and keeps doing so;
    forced (``fused=True``) the error surfaces."""
    from mlora.batch.adapters.residency import host as host_mod
    from mlora.kernels import wordstats

    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("no such instruction\ndetails")

    monkeypatch.setattr(wordstats, "word_partials", broken)
    monkeypatch.setattr(host_mod, "_WORDSTATS_FAILED", None)
    monkeypatch.setattr(host_mod, "takes_word_stats", lambda flat: True)  # as a GPU's large 16-bit view would
    x = (torch.randn(5000, generator=torch.Generator().manual_seed(2)) * 4).to(torch.bfloat16)
    want = view_stats(x).tolist()
    with pytest.warns(RuntimeWarning, match="no such instruction"):
        parts = host_mod.view_stats_parts({"x": x, "y": x.clone()})
    assert host_mod._WORDSTATS_FAILED == "RuntimeError: no such instruction"
    assert [p.stats() for p in parts] == [{"x": want, "y": want}]
    again = host_mod.view_stats_parts({"x": x})  # no second attempt, no second warning
    assert calls == [1] and again[0].stats() == {"x": want}
    with pytest.raises(RuntimeError):
        host_mod.view_stats_parts({"x": x}, fused=True)


@pytest.mark.parametrize("poke, code", [
    (None, None),
    (lambda v: v["A"][1, 10].fill_(1.0), "E_VALIDATE_TAIL"),  # a stale value in A's padded rank rows
    (lambda v: v["B"][0, 7, 1].mul_(2.0), "E_VALIDATE_DIGEST"),  # one landed value of B changed
    (lambda v: v["B"][1, 3, 0].fill_(float("inf")), "E_VALIDATE_NONFINITE"),
])
def test_large_16_bit_views_validate_through_the_word_stats_kernel(monkeypatch, poke, code):
    """A load's probe as on a GPU: the slot's large bf16 A and B views (over SMALL_VIEW
    elements) take one word-stats launch together (on a CPU-only machine under the interpreter,
    on a GPU machine compiled: the slot bank lives on the GPU, the artifact on the host) and a
    correct load is accepted on those numbers alone; a stale tail, a changed value and an
    infinity each fail with their code."""
    from mlora.batch.adapters.residency import host as host_mod

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(host_mod, "takes_word_stats", lambda flat: flat.dtype == torch.bfloat16)
    A = torch.zeros(3, 2, 16, 160, dtype=torch.bfloat16, device=dev)  # 5120 elements per slot view
    B = torch.zeros(3, 2, 160, 16, dtype=torch.bfloat16, device=dev)
    storage = SlotStorage({"A": (A, 0), "B": (B, 0)})
    g = torch.Generator().manual_seed(4)
    art = HostArtifact("k", "k", [Piece("A", (0, slice(0, 8)), (torch.randn(8, 160, generator=g) + 1).to(torch.bfloat16)),
                                  Piece("A", (1, slice(0, 4)), torch.randn(4, 160, generator=g).to(torch.bfloat16)),
                                  Piece("B", (0, slice(None), slice(0, 8)), torch.randn(160, 8, generator=g).to(torch.bfloat16)),
                                  Piece("B", (1, slice(None), slice(0, 4)), torch.randn(160, 4, generator=g).to(torch.bfloat16))])
    views = _land(storage, art)
    probe = storage_mod.probe_landed(views)
    assert [p.names for p in probe.parts] == [["A", "B"]] and probe.parts[0].counts == [5120, 5120]
    # the residency manager's probe, from buffers prepared for the slot: the same numbers
    monkeypatch.setattr(storage_mod, "PREPARED_DEVICES", ("cuda", "cpu"))
    prober = storage_mod.SlotProber()
    prepared = prober.probe(0, views)
    _sync(dev)  # a probe is read once the stream has reached its read-backs (the manager: after the copy event)
    assert prober.prepared == 1 and prepared.all_stats() == probe.all_stats()
    if poke is None:
        validate_landed(storage, views, art, probe)
        validate_landed(storage, views, art, prepared)
        return
    del prepared
    poke(views)
    for make in (storage_mod.probe_landed, lambda v: prober.probe(0, v)):
        issued = make(views)
        _sync(dev)
        with pytest.raises(ValidationError) as e:
            validate_landed(storage, views, art, issued)
        assert e.value.code == code
    assert prober.prepared == 2


def test_a_prepared_probes_host_buffers_share_one_allocation_without_overlap():
    """_HostBuffers: one allocation (one page-locking call on a GPU), each tensor 64-byte aligned,
    of its shape and dtype, none overlapping another (written in turn, read back intact)."""
    specs = [((4, 2), torch.int32), ((3,), torch.float32), ((7, 4), torch.int64), ((0,), torch.int32), ((5,), torch.int64)]
    hb = storage_mod._HostBuffers(specs, pin=False)
    assert [(tuple(t.shape), t.dtype) for t in hb.tensors] == specs
    base = hb.storage.data_ptr()
    assert all((t.data_ptr() - base) % 64 == 0 and t.untyped_storage().data_ptr() == base for t in hb.tensors)
    for i, t in enumerate(hb.tensors):
        t.fill_(i + 1)
    assert all(bool((t == i + 1).all()) for i, t in enumerate(hb.tensors))


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def test_prepared_probes_reuse_a_slots_buffers_only_once_the_last_probe_is_dropped(monkeypatch):
    """SlotProber: one slot's probes share buffers, so a probe issued while the slot's last one
    is alive takes the plain path (the first one's numbers are not overwritten); once it is
    dropped the buffers are used again; other views for the slot (another bank) get new
    buffers; every probe's numbers equal the plain probe's of the same bytes."""
    from mlora.batch.adapters.residency import host as host_mod

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(host_mod, "takes_word_stats", lambda flat: flat.dtype == torch.bfloat16)
    monkeypatch.setattr(storage_mod, "PREPARED_DEVICES", ("cuda", "cpu"))
    g = torch.Generator().manual_seed(9)

    def views_of(n_a):
        return {"A": (torch.randn(2, n_a, generator=g) * 3).to(torch.bfloat16).to(dev),
                "B": (torch.randn(5000, 3, generator=g)).to(torch.bfloat16).to(dev),
                "ranks": torch.tensor([3, 1, 2, 3], dtype=torch.int32, device=dev),
                "scales": torch.rand(4, generator=g).to(dev)}

    prober = storage_mod.SlotProber()
    views = views_of(40000)
    first = prober.probe(7, views)
    _sync(dev)
    want = storage_mod.probe_landed(views).all_stats()
    views["A"][1, 5:9] = 1.5  # the slot loaded again while the first probe is alive
    views["ranks"][0] = 2
    second = prober.probe(7, views)
    _sync(dev)
    assert prober.prepared == 1  # the plain path: the first probe's buffers are its own
    assert first.all_stats() == want
    assert second.all_stats() == storage_mod.probe_landed(views).all_stats() != want
    del first, second
    views["B"][100, 2] = -4.0
    third = prober.probe(7, views)
    _sync(dev)
    assert prober.prepared == 2 and third.all_stats() == storage_mod.probe_landed(views).all_stats()
    del third
    other = views_of(33000)  # another bank's views for the same slot id: new buffers
    fourth = prober.probe(7, other)
    _sync(dev)
    assert prober.prepared == 3 and fourth.all_stats() == storage_mod.probe_landed(other).all_stats()


def test_a_bank_prepares_every_slots_probe_when_it_is_made(monkeypatch):
    """ResidencyBank: each slot's probe buffers are built when the bank is made (the first
    load into a slot allocates nothing while issuing); a load then probes from them."""
    from mlora.batch.adapters.residency import ResidencyBank
    from mlora.batch.adapters.residency import host as host_mod
    from mlora.batch.adapters.residency import storage as storage_mod

    monkeypatch.setattr(storage_mod, "PREPARED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(host_mod, "takes_word_stats", lambda flat: flat.dtype == torch.bfloat16)
    built = []
    real = storage_mod._ProbePlan.build
    monkeypatch.setattr(storage_mod._ProbePlan, "build", classmethod(lambda cls, views: built.append(1) or real(views)))
    shapes = {"qkv": (64, (64, 16, 16))}
    bank = ResidencyBank(2, shapes, 3, 8, torch.bfloat16, "cpu", prefetch_workers=0)
    prober, storage = bank.residency.prober, bank.residency.storage
    assert len(built) == 3 and sorted(prober._plans) == [0, 1, 2]
    assert all(prober._plans[s] is not None and prober._plans[s].matches(storage.views(s, [])) for s in range(3))
    prober.prepare(1, storage.views(1, []))
    probe = prober.probe(2, storage.views(2, []))  # a load's probe: from the prepared buffers, nothing built
    assert len(built) == 3 and prober.prepared == 1
    assert probe.all_stats() == storage_mod.probe_landed(storage.views(2, [])).all_stats()
