"""A follower rank for the tensor-parallel residency tests (tests/test_tp_residency.py), in a module
of its own so that the spawned rank imports it by name: ``tpfollow.follow`` whose writes of one
adapter into a slot fail, as on a rank that cannot read its copy of the adapter's files."""

from mlora.batch.adapters.catalog import AdapterError
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
