"""The residency engine's errors: one class per thing a caller may catch, a stable ``code`` on each.

Owns the codes only; raising them is the business of the modules that detect
the broken invariant. Codes::

    E_RESIDENCY_TRANSITION           a state move outside the transition table (names from/to)
    E_RESIDENCY_NOT_EVICTABLE        eviction asked of a slot that fails the eligibility predicate (names the clauses)
    E_RESIDENCY_NOT_PUBLISHED        a bind to an adapter generation that is not published
    E_RESIDENCY_STALE_GENERATION     a launch named a handle whose slot/pointer generation moved on
    E_RESIDENCY_PUBLISH_BEFORE_COPY  publication asked before the copy-complete event
    E_RESIDENCY_REUSE_BEFORE_EVENT   a slot would be overwritten before its last-use event completed
    E_RESIDENCY_HOST_SOURCE          the verified host source of an adapter cannot be read
    E_RESIDENCY_COPY                 a host-to-device copy failed (partial bytes may have landed)
    E_RESIDENCY_NO_HOST_SOURCE       rollback found no verified host source to restore a victim from
    E_RESIDENCY_RESTORE_FAILED       rollback could not restore a victim (its copy or validation failed)
    E_RESIDENCY_MIRROR               another tensor-parallel rank could not write its cut of the adapter into
                                     the slot (the message names the rank and its own code)
    E_VALIDATE_LAYOUT / _SCALE / _NONFINITE / _DIGEST / _TAIL   what landed is not what was sent (or, raised
                                     as ArtifactRefused, the host artifact itself is not servable)
    E_ADMISSION_CAPACITY             free + reclaimable pages (or slots) < the joint demand
    E_ADMISSION_KERNEL_CONTRACT      the adapter does not fit the slot layout (rank, shape)
    E_KV_CAPACITY                    KV growth found no free or reclaimable page (nothing over-committed)
    E_LEDGER_CONSERVATION / _LEAKED_RESERVATION / _OWNER_MISMATCH   a page-ledger audit failed
    E_ADAPTER_LOAD                   an adapter failed to load on every attempt of the retry budget
"""

from __future__ import annotations

from mlora.batch.adapters.catalog import AdapterError
from mlora.batch.errors import CodedError


class ResidencyError(CodedError, RuntimeError):
    """A residency invariant would break; nothing was changed unless the subclass says so."""


class TransitionError(ResidencyError):
    def __init__(self, what: str, from_state, to_state):
        super().__init__("E_RESIDENCY_TRANSITION", f"{what}: {from_state.value} -> {to_state.value} is not a "
                         "transition of the residency state machine (docs/design.md, Residency states)")
        self.from_state, self.to_state = from_state, to_state


class NotEvictable(ResidencyError):
    """``reasons`` lists the failing clauses of the eligibility predicate, in predicate order."""

    def __init__(self, what: str, reasons: list[str]):
        super().__init__("E_RESIDENCY_NOT_EVICTABLE", f"{what} is not evictable: {', '.join(reasons)}")
        self.reasons = reasons


class AdmissionError(ResidencyError):
    """Joint admission refused; the pool, slots and catalog are unchanged. ``reason`` is one
    word ("joint_adapter_kv_capacity", "adapter_slot_capacity", "adapter_kernel_contract")."""

    def __init__(self, code: str, reason: str, message: str, demand=None):
        super().__init__(code, message)
        self.reason, self.demand = reason, demand


class LoadError(ResidencyError):
    """One load attempt failed after its reservation; raised only once the attempt was rolled back."""


class MirrorError(LoadError):
    """A copy's mirror (``Residency(mirror=...)``: another tensor-parallel rank writing its cut
    into the same slot) failed; the attempt is rolled back and retried like a failed copy."""

    def __init__(self, message: str):
        super().__init__("E_RESIDENCY_MIRROR", message)


class ValidationError(LoadError):
    """What landed in a slot (or the artifact about to be copied) is not servable."""


class RollbackError(ResidencyError):
    """Compensating work itself failed: the attempt is closed and every page is accounted for,
    but a victim could not be restored (it is absent now). ``__cause__`` is the original failure."""


class KVCapacity(ResidencyError):
    def __init__(self, attempt: str, needed: int, available: int):
        super().__init__("E_KV_CAPACITY", f"request {attempt} needs {needed} more KV pages, {available} free or "
                         "reclaimable; preempt or queue it (the pool is never over-committed)")
        self.needed, self.available = needed, available


class LedgerError(ResidencyError):
    pass


class ArtifactRefused(AdapterError):
    """The host artifact fails the layout or metadata check (E_VALIDATE_*) before any victim was
    touched: nothing to roll back, nothing to retry. A catalog ``AdapterError``: its rows fail closed."""


class AdapterLoadError(AdapterError):
    """E_ADAPTER_LOAD: every attempt of the retry budget failed and was rolled back.
    A catalog ``AdapterError`` so that the engine turns that adapter's rows into error rows."""

    def __init__(self, adapter_id: str, attempts: list[str], last: ResidencyError):
        super().__init__("E_ADAPTER_LOAD", f"adapter {adapter_id!r} failed to load on {len(attempts)} attempt(s) "
                         f"({', '.join(attempts)}); last error {last}. The residency state was rolled back; "
                         "check the device and the adapter files, then rerun with --resume", adapter_id)
        self.attempts, self.last = attempts, last
