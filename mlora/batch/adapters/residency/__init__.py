"""Adapter residency (docs/design.md, Residency states): which adapter generation sits
in which device slot, how it gets there, and when it may leave.

Owns the residency engine; must not know the model or the scheduler's
policy (the engine asks, this package answers and keeps the invariants).
One concept per module::

    states.py    the residency state machine and its transition table
    errors.py    the error classes and their stable codes
    events.py    Event protocol; CPU and CUDA copiers (side stream + events)
    pool.py      the joint page ledger: free | reserved(txn) | owned(object, generation)
    host.py      verified host artifacts and the bounded host cache
    pinned.py    page-locked blocks for host images, pinned once before the job
    storage.py   slot storage (fixed max-rank slots, vector pages) and validation of landed bytes
    prefetch.py  host-tier prefetch threads
    build.py     optional host-image builds in spawned worker processes
    faults.py    the test-only fault injector
    manager.py   Residency: counts, eligibility, load transactions, rollback, leases, launches, admission
    bank.py      ResidencyBank: the SlotBank seam of adapters/slots.py (ensure / context) over a Residency
"""

from mlora.batch.adapters.residency.bank import BankError, ResidencyBank, ResidencyContext
from mlora.batch.adapters.residency.errors import (
                     AdapterLoadError,
                     AdmissionError,
                     ArtifactRefused,
                     KVCapacity,
                     LedgerError,
                     LoadError,
                     MirrorError,
                     NotEvictable,
                     ResidencyError,
                     RollbackError,
                     TransitionError,
                     ValidationError,
)
from mlora.batch.adapters.residency.events import DONE, CpuCopier, CudaCopier, Event, ManualEvent, copier_for
from mlora.batch.adapters.residency.faults import FaultInjector
from mlora.batch.adapters.residency.host import HostArtifact, HostCache, Piece
from mlora.batch.adapters.residency.manager import (
                     Admission,
                     Demand,
                     Entry,
                     Handle,
                     Launch,
                     RequestAttempt,
                     Residency,
                     ResidencyStats,
                     Slot,
                     Txn,
)
from mlora.batch.adapters.residency.pool import Owner, PagePool
from mlora.batch.adapters.residency.states import BINDABLE, TRANSITIONS, State, check_transition
from mlora.batch.adapters.residency.storage import PagedStorage, SlotStorage, validate_landed

__all__ = [
    "Admission", "AdapterLoadError", "AdmissionError", "ArtifactRefused", "BINDABLE", "BankError", "CpuCopier", "CudaCopier", "DONE",
    "Demand", "Entry", "Event", "FaultInjector", "Handle", "HostArtifact", "HostCache", "KVCapacity", "Launch",
    "LedgerError", "LoadError", "ManualEvent", "MirrorError", "NotEvictable", "Owner", "PagePool", "PagedStorage", "Piece",
    "RequestAttempt", "Residency", "ResidencyBank", "ResidencyContext", "ResidencyError", "ResidencyStats",
    "RollbackError", "Slot", "SlotStorage", "State", "TRANSITIONS", "TransitionError", "Txn", "ValidationError",
    "check_transition", "copier_for", "validate_landed",
]
