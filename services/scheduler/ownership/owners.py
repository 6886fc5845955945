"""Who can hold a slot.

An owner id packs its kind into the low bits, so counting slots by owner kind is one
vectorised `bincount` over a pool's owner table: counts are derived from ownership,
never kept beside it. Ids are never reused, so a handle naming an owner that has since
lost its slots can never pass an ownership check by accident.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

KIND_BITS = 3
KIND_MASK = (1 << KIND_BITS) - 1


class OwnerKind(IntEnum):
    FREE = 0
    REQUEST = 1
    SESSION = 2
    CACHE = 3
    TRACK = 4
    ADMISSION = 5  # a group reservation held by one admission round


@dataclass(frozen=True, slots=True)
class Owner:
    id: int
    kind: OwnerKind
    name: str

    def __str__(self) -> str:
        return "free" if self.kind is OwnerKind.FREE else f"{self.kind.name.lower()}:{self.name}"


FREE = Owner(0, OwnerKind.FREE, "")
# Owner id written in slot 0 of every pool: the padding sink belongs to nobody and can
# never be transferred, so naming it in any transfer fails the ownership check.
SINK_ID = -1


def kind_of(owner_id: int) -> OwnerKind:
    return OwnerKind(owner_id & KIND_MASK)


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
        owner = Owner((self._next_serial << KIND_BITS) | kind, kind, name)
        self._next_serial += 1
        self._live[owner.id] = owner
        self.declared.append(owner)
        return owner

    def forget(self, owner: Owner) -> None:
        self._live.pop(owner.id, None)

    def is_live(self, owner_id: int) -> bool:
        return owner_id == 0 or owner_id in self._live

    def live(self) -> list[Owner]:
        return list(self._live.values())

    def describe(self, owner_id: int) -> str:
        if owner_id == 0:
            return "free"
        if owner_id == SINK_ID:
            return "sink"
        owner = self._live.get(owner_id)
        if owner is not None:
            return str(owner)
        return f"{kind_of(owner_id).name.lower()}#{owner_id >> KIND_BITS}(retired)"
