"""Who can hold a slot.

An owner id packs its kind into the low bits, so counting slots by owner kind is one
vectorised `bincount` over a pool's owner table: counts are derived from ownership,
never kept beside it. Ids are never reused, so a handle naming an owner that has since
lost its slots can never pass an ownership check by accident.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.owners import (
    KIND_BITS,
    KIND_MASK,
    SINK_ID,
    OwnerKind,
    anonymous,
    kind_of,
    label,
    owner_id,
)

# re-exported: the encoding lives in shared/ so the session store needs nothing from here
__all__ = [
    "FREE",
    "KIND_BITS",
    "KIND_MASK",
    "SINK_ID",
    "Owner",
    "OwnerKind",
    "OwnerRegistry",
    "kind_of",
]


@dataclass(frozen=True, slots=True)
class Owner:
    id: int
    kind: OwnerKind
    name: str

    def __str__(self) -> str:
        return label(self.kind, self.name)


FREE = Owner(0, OwnerKind.FREE, "")


class OwnerRegistry:
    """Issues owner ids and remembers the names of live owners for reports."""

    def __init__(self) -> None:
        self._next_serial = 1
        self._live: dict[int, Owner] = {}
        self.declared: list[Owner] = []  # new since the event shipper last took them

    def take_declared(self) -> list[Owner]:
        taken, self.declared = self.declared, []
        return taken

    def new(self, kind: OwnerKind, name: str) -> Owner:
        if kind is OwnerKind.FREE:
            raise ValueError("the free list is a single owner, FREE")
        owner = Owner(owner_id(self._next_serial, kind), kind, name)
        self._next_serial += 1
        self._live[owner.id] = owner
        self.declared.append(owner)
        return owner

    def forget(self, owner: Owner) -> None:
        self._live.pop(owner.id, None)

    def live(self) -> list[Owner]:
        return list(self._live.values())

    def describe(self, owner: int) -> str:
        live = self._live.get(owner)
        if live is not None:
            return str(live)
        return anonymous(owner) + ("(retired)" if owner > 0 else "")
