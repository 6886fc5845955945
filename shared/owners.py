"""How an owner id is encoded: its kind in the low bits, a never-reused serial above.

Shared because the session store decodes the ids it replays (counts by kind, names of
owners it was never told about) without importing anything of the scheduler, whose
ledger it checks.
"""

from __future__ import annotations

from enum import IntEnum

KIND_BITS = 3
KIND_MASK = (1 << KIND_BITS) - 1
# Owner id written in slot 0 of every pool: the padding sink belongs to nobody and can
# never be transferred, so naming it in any transfer fails the ownership check.
SINK_ID = -1


class OwnerKind(IntEnum):
    FREE = 0
    REQUEST = 1
    SESSION = 2
    CACHE = 3
    TRACK = 4
    TRANSIT = 5  # host or disk slots a tier move of a step in flight still reads
    SPECULATIVE = 6  # a running request's slots for the states of drafts being verified


def owner_id(serial: int, kind: OwnerKind) -> int:
    return (serial << KIND_BITS) | kind


def kind_of(owner: int) -> OwnerKind:
    return OwnerKind(owner & KIND_MASK)


def label(kind: OwnerKind, name: str) -> str:
    """An owner's name in reports: `request:r1`, `session:chat`."""
    return "free" if kind is OwnerKind.FREE else f"{kind.name.lower()}:{name}"


def anonymous(owner: int) -> str:
    """The name of an owner whose declared name is not known (any more)."""
    if owner == 0:
        return "free"
    if owner == SINK_ID:
        return "sink"
    return f"{kind_of(owner).name.lower()}#{owner >> KIND_BITS}"
