"""A speculating request's slots for the Mamba states of the drafts it verifies.

A Mamba state cannot be rolled back, so a verify step keeps the state after each of its
positions: after the first j + 1 in the j-th speculative slot, after all of them in the
request's working slot as any step does (docs/speculative.md). Once the scheduler knows
how many positions count (the accepted drafts, cut where a stop string, a stop token or
the token limit ends the request), it commits that one state by exchanging two slots'
owners in one transaction: the speculative slot holding it becomes the request's working
slot and the working slot the step wrote becomes a speculative slot. Nothing is copied,
and a state past the committed length is never the request's, so never a session's, the
prefix cache's, a tier's or a record's: those take only the request's committed slot.

The slots belong to their own owner (`speculative:<rid>`), taken with the request's other
slots at admission and freed with them, so the ledger says at every moment which states
are drafts' and the session store holds each verify row's writes to that owner; none is
held at idle.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.allocators.working_slots import WorkingSlots
from services.scheduler.ownership.lease import Lease
from services.scheduler.ownership.owners import Owner


@dataclass(slots=True)
class SpecSlots:
    owner: Owner  # speculative:<rid>
    leases: list[Lease]  # one slot each

    def for_drafts(self, drafts: int) -> list[int]:
        """The slots a verify row of `drafts` drafts writes, in position order."""
        return [lease.slot for lease in self.leases[:drafts]]

    def commit(self, state: WorkingSlots, written: int, kept: int, drafts: int) -> None:
        """The verify step that wrote its last state to working slot `written` ran, and
        `kept` of its drafts + 1 positions count: that state becomes the request's
        committed one."""
        if not 1 <= kept <= drafts + 1:
            raise ValueError(f"{self.owner}: {kept} positions kept of {drafts + 1}")
        if kept == drafts + 1:
            state.commit(written)
            return
        chosen = self.leases[kept - 1]
        mine = chosen.move_to(state.owner, "accept")
        replaced = state.exchange(written, mine)
        self.leases[kept - 1] = replaced.move_to(self.owner, "accept")
        state.commit(mine.slot)

    def held(self) -> list[int]:
        return [int(lease.held) for lease in self.leases]

    def release(self, reason: str) -> None:
        for lease in self.leases:
            lease.release(reason)
