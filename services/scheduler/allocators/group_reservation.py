"""Group reservation: an admission round reserves up to n slots in one bulk pop, hands
them out one at a time, and returns the rest when the round ends.

The reserved slots are owned by the round (`admission:<name>`), not silently "off the
free list", so the ledger sees them and the idle check flags a round left open.
"""

from __future__ import annotations

from services.scheduler.ownership.ledger import Ledger
from services.scheduler.ownership.owners import Owner, OwnerKind
from services.scheduler.ownership.slot_pool import SlotPool


class GroupReservation:
    def __init__(self, ledger: Ledger, pool: SlotPool, want: int, name: str) -> None:
        self.ledger = ledger
        self.pool = pool
        self.owner = ledger.new_owner(OwnerKind.ADMISSION, name)
        got = min(want, pool.free_count)
        self._slots = pool.alloc(got, self.owner, "reserve").tolist() if got else []
        self._slots.reverse()  # hand out in pop order from the end
        self.closed = False

    @property
    def remaining(self) -> int:
        return len(self._slots)

    def take(self, receiver: Owner) -> int:
        """One reserved slot for `receiver`; falls back to the free list when drained."""
        if self.closed:
            raise RuntimeError(f"{self.owner} is closed")
        if not self._slots:
            return self.pool.alloc_one(receiver)
        slot = self._slots.pop()
        self.pool.transfer_one(slot, self.owner, receiver, "reserved")
        return slot

    def close(self) -> None:
        """Return what was not handed out; idempotent."""
        if self.closed:
            return
        for slot in self._slots:
            self.pool.free_one(slot, self.owner, "unreserve")
        self._slots.clear()
        self.closed = True
        self.ledger.retire(self.owner)

    def __enter__(self) -> GroupReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
