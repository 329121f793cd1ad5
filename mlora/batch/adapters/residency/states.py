"""The residency state machine (docs/design.md, Residency states): one adapter generation's device life.

Owns the nine states, the legal transitions and what each state allows.
Must not know pages, slots or tensors: ``manager.py`` moves entries and calls
:func:`check_transition` on every move.

The forward chain is the spec's::

    absent -> host_ready -> reserved -> loading -> validated -> published -> active -> idle -> retiring -> absent

plus the edges a transaction needs and the spec implies: idle -> active (bind
again), published/active -> retiring (a replacement or a failure after
publication stops new binds), and the rollback edges reserved/loading/validated
-> host_ready (the attempt is undone, the host copy remains) and host_ready ->
absent (the attempt is abandoned). A generation never goes back to published:
restoring a victim publishes a *new* generation.
"""

from __future__ import annotations

from enum import Enum

from mlora.batch.adapters.residency.errors import TransitionError


class State(str, Enum):
    ABSENT = "absent"
    HOST_READY = "host_ready"
    RESERVED = "reserved"
    LOADING = "loading"
    VALIDATED = "validated"
    PUBLISHED = "published"
    ACTIVE = "active"
    IDLE = "idle"
    RETIRING = "retiring"


S = State
TRANSITIONS: dict[State, frozenset[State]] = {
    S.ABSENT: frozenset({S.HOST_READY}),
    S.HOST_READY: frozenset({S.RESERVED, S.ABSENT}),
    S.RESERVED: frozenset({S.LOADING, S.HOST_READY}),
    S.LOADING: frozenset({S.VALIDATED, S.HOST_READY}),
    S.VALIDATED: frozenset({S.PUBLISHED, S.HOST_READY}),
    S.PUBLISHED: frozenset({S.ACTIVE, S.RETIRING}),
    S.ACTIVE: frozenset({S.IDLE, S.RETIRING}),
    S.IDLE: frozenset({S.ACTIVE, S.RETIRING}),
    S.RETIRING: frozenset({S.ABSENT}),
}

# The transition table's derived sets. "Bindable": a new batch or request may bind this generation.
PAGES_ASSIGNED = frozenset({S.RESERVED, S.LOADING, S.VALIDATED, S.PUBLISHED, S.ACTIVE, S.IDLE, S.RETIRING})
VISIBLE = frozenset({S.PUBLISHED, S.ACTIVE, S.IDLE})
BINDABLE = frozenset({S.PUBLISHED, S.ACTIVE, S.IDLE})
EVICTABLE_STATES = frozenset({S.PUBLISHED, S.IDLE})  # eligibility's state clause (docs/design.md, Eviction eligibility)


def check_transition(what: str, from_state: State, to_state: State) -> None:
    if to_state not in TRANSITIONS[from_state]:
        raise TransitionError(what, from_state, to_state)
