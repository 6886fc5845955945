"""A running request's Mamba working state, in a ring of slots it steps around.

Every step reads the state from one slot and writes its result to the next. With up to
`depth` steps in flight while the next is planned, a ring of `depth + 1` slots gives the
new step a slot none of them writes: whichever of them turns out to be the request's
last (a stop token), the state it wrote, the one its history describes, stays intact,
and the speculative steps after it only wrote the others. (The new step may write the
slot committed now: it runs after the steps in flight, so that state is then either
superseded or, if one of them is refused, never needed, since nothing planned on top of
a refused step runs.) Which slot is committed and which the next step reads are fields
of this one object, so no caller keeps a slot number of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.ownership.lease import Lease
from services.scheduler.ownership.owners import Owner


@dataclass(slots=True)
class WorkingSlots:
    leases: tuple[Lease, ...]  # all owned by the running request; at least two
    committed: int = 0  # entry holding the state after the last completed step
    head: int = 0  # entry holding the state after the last planned step

    def advance(self) -> tuple[int, int]:
        """(read, write) slots of the step being planned for this request."""
        nxt = (self.head + 1) % len(self.leases)
        read, write = self.leases[self.head], self.leases[nxt]
        self.head = nxt
        return read.slot, write.slot

    def commit(self, written: int) -> None:
        """The step that wrote slot `written` has completed: its state is the request's."""
        for entry, lease in enumerate(self.leases):
            if int(lease.held) == written:
                self.committed = entry
                return
        raise ValueError(f"slot {written} is not one of this request's working slots")

    def exchange(self, written: int, incoming: Lease) -> Lease:
        """Put `incoming` (a slot just made the request's) in the entry that holds slot
        `written`; returns the lease it replaces (spec_slots.py, committing a verify)."""
        for entry, lease in enumerate(self.leases):
            if int(lease.held) == written:
                self.leases = (*self.leases[:entry], incoming, *self.leases[entry + 1 :])
                return lease
        raise ValueError(f"slot {written} is not one of this request's working slots")

    @property
    def owner(self) -> Owner:
        return self.leases[0].owner

    def rewind(self) -> None:
        """The steps planned after the last completed one will not count."""
        self.head = self.committed

    @property
    def current(self) -> Lease:
        """The committed state: what a session keeps, what a cache copy fills."""
        return self.leases[self.committed]

    @property
    def spares(self) -> list[Lease]:
        return [lease for entry, lease in enumerate(self.leases) if entry != self.committed]

    def held(self) -> list[int]:
        return [int(lease.held) for lease in self.leases]
