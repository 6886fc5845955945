"""Leases: the handle a holder keeps for slots it owns.

A lease is (pool, owner, slots). It never caches validity: every use checks the pool's
owner table, and owner ids are never reused, so once any transfer moves a leased slot
away the old lease fails at its next use, naming the slot, its current owner and the
transfer that moved it. A holder therefore cannot keep using, or skip re-allocating,
a slot it handed on (lessons 1 and 2 of docs/ownership.md).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from services.scheduler.ownership.errors import OwnershipError, StaleHandle
from services.scheduler.ownership.owners import Owner
from services.scheduler.ownership.slot_pool import SlotPool


class Lease(NamedTuple):
    pool: SlotPool
    owner: Owner
    held: int | np.ndarray  # one slot, or an int64 array of slots

    @property
    def slot(self) -> int:
        """The single leased slot, checked (the owner table read directly: every
        planned row reads three)."""
        if not self.pool.owns(self.owner, self.held):
            raise self._stale("used")
        return int(self.held)

    @property
    def slots(self) -> np.ndarray:
        """All leased slots, checked."""
        self.check()
        return np.atleast_1d(self.held)

    def is_valid(self) -> bool:
        return self.pool.owns(self.owner, self.held)

    def check(self) -> None:
        if not self.is_valid():
            raise self._stale("used")

    def move_to(self, receiver: Owner, reason: str) -> Lease:
        """Transfer every leased slot to `receiver`; this lease is dead afterwards."""
        try:
            if isinstance(self.held, np.ndarray):
                self.pool.transfer(self.held, self.owner, receiver, reason)
            else:
                self.pool.transfer_one(self.held, self.owner, receiver, reason)
        except OwnershipError as err:
            raise self._stale(reason) from err
        return new_lease(self.pool, receiver, self.held)

    def release(self, reason: str = "free") -> None:
        """Return every leased slot to the free list; this lease is dead afterwards."""
        try:
            if isinstance(self.held, np.ndarray):
                self.pool.free(self.held, self.owner, reason)
            else:
                self.pool.free_one(self.held, self.owner, reason)
        except OwnershipError as err:
            raise self._stale(reason) from err

    def _stale(self, action: str) -> StaleHandle:
        slots = np.atleast_1d(self.held)
        moved = slots[self.pool.owner_view[slots] != self.owner.id]
        return StaleHandle(
            f"stale lease of {self.owner} {action} on pool {self.pool.name}: slots "
            f"{moved.tolist()} were transferred away\n"
            + self.pool.ledger.describe(self.pool, moved)
        )


def new_lease(pool: SlotPool, owner: Owner, held: int | np.ndarray) -> Lease:
    """Build a lease without NamedTuple's Python-level __new__ (this is on the hot path)."""
    return tuple.__new__(Lease, (pool, owner, held))
