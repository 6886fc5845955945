"""A running request's Mamba working state, in two slots it alternates between.

Every step reads the state from one slot and writes its result to the other. With one
step in flight while the next is planned (pipeline depth 1), the state after the last
*completed* step is therefore never the target of a step planned after it: when a request
turns out to have ended (a stop token) while its next step already runs, the state its
history describes is still intact in the committed slot, and the speculative step only
wrote the spare one. Which slot is committed and which the next step reads are fields of
this one object, so no caller keeps a slot number of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.ownership.lease import Lease


@dataclass(slots=True)
class WorkingPair:
    leases: tuple[Lease, Lease]  # both owned by the running request
    committed: int = 0  # entry holding the state after the last completed step
    head: int = 0  # entry holding the state after the last planned step

    def advance(self) -> tuple[int, int]:
        """(read, write) slots of the step being planned for this request."""
        read, write = self.leases[self.head], self.leases[1 - self.head]
        self.head = 1 - self.head
        return read.slot, write.slot

    def commit(self, written: int) -> None:
        """The step that wrote slot `written` has completed: its state is the request's."""
        for entry, lease in enumerate(self.leases):
            if int(lease.held) == written:
                self.committed = entry
                return
        raise ValueError(f"slot {written} is not one of this request's working slots")

    def rewind(self) -> None:
        """The steps planned after the last completed one will not count."""
        self.head = self.committed

    @property
    def current(self) -> Lease:
        """The committed state: what a session keeps, what a cache copy fills."""
        return self.leases[self.committed]

    @property
    def spare(self) -> Lease:
        return self.leases[1 - self.committed]

    def held(self) -> list[int]:
        return [int(lease.held) for lease in self.leases]
