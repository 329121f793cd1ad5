"""Follower ranks for the tensor-parallel residency tests (tests/test_tp_residency.py), in a module
of their own so that the spawned rank imports them by name: ``tpfollow.follow`` whose writes of one
adapter into a slot fail, as on a rank that cannot read its copy of the adapter's files, or whose
reads of adapter files are counted (and one adapter's fail)."""

from mlora.batch.adapters import slots
from mlora.batch.adapters.catalog import AdapterChanged, AdapterError
from mlora.batch.adapters.slots import SlotBank
from mlora.batch.engine.tpfollow import follow


def follow_failing_loads(collective, base, devices, dtype_name, threads, adapter: str, times: int | None = None) -> dict:
    """``follow``, with this rank's writes of ``adapter`` failing ``times`` times (None: every time)."""
    write = SlotBank.load_into
    failed = []

    def load_into(bank, slot, p):
        if p.id == adapter and (times is None or len(failed) < times):
            failed.append(slot)
            raise AdapterError("E_ADAPTER_CHANGED", f"adapter {adapter!r} cannot be read on this rank (a test's "
                               "fault)", adapter)
        write(bank, slot, p)

    SlotBank.load_into = load_into
    return follow(collective, base, devices, dtype_name, threads)


def follow_counting_reads(collective, base, devices, dtype_name, threads, fail: str | None = None) -> dict:
    """``follow``, counting this rank's reads of adapter files (``catalog.load_factors`` calls, by
    adapter id: ``"reads"`` in its report); every read of ``fail`` fails, as on a rank whose copy
    of that adapter's files changed after pinning."""
    read = slots.load_factors
    reads: dict[str, int] = {}

    def load_factors(p, dtype, device):
        reads[p.id] = reads.get(p.id, 0) + 1
        if p.id == fail:
            raise AdapterChanged(p.id, "its files cannot be read on this rank (a test's fault)")
        return read(p, dtype, device)

    slots.load_factors = load_factors
    return follow(collective, base, devices, dtype_name, threads) | {"reads": reads}
