"""The ownership ledger: every pool, every owner, every event, in one place.

Pools change owners; the ledger names owners, keeps the event log, retires owners (an
owner that still holds slots cannot retire: that is a slot dropped without a transfer),
and writes the fault reports that name slots, owners and the event that last moved each.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from services.scheduler.ownership.errors import LeakError, OwnershipError
from services.scheduler.ownership.events import EventLog
from services.scheduler.ownership.owners import Owner, OwnerKind, OwnerRegistry
from services.scheduler.ownership.slot_pool import OwnerArg, SlotPool


class Ledger:
    def __init__(self, keep_events: int = 1 << 16) -> None:
        self.owners = OwnerRegistry()
        self.events = EventLog(keep_events)
        self.pools: dict[str, SlotPool] = {}
        self.by_id: list[SlotPool] = []

    def add_pool(self, name: str, capacity: int, scalar: bool = False) -> SlotPool:
        """`scalar`: the pool is moved mostly one slot at a time (slot_pool.py)."""
        if name in self.pools:
            raise ValueError(f"pool {name} exists")
        pool = SlotPool(self, len(self.by_id), name, capacity, scalar)
        self.pools[name] = pool
        self.by_id.append(pool)
        return pool

    def new_owner(self, kind: OwnerKind, name: str) -> Owner:
        return self.owners.new(kind, name)

    def retire(self, owner: Owner) -> None:
        """End an owner's life; it must hold nothing, or the slots it holds would leak."""
        held = {pool.name: pool.owned_by(owner) for pool in self.by_id}
        held = {name: slots for name, slots in held.items() if len(slots)}
        if held:
            lines = [self.describe(self.pools[name], slots) for name, slots in held.items()]
            raise LeakError(f"{owner} ended still holding slots:\n" + "\n".join(lines))
        self.owners.forget(owner)

    # ---- reports ----
    def describe(self, pool: SlotPool, slots: Iterable[int], limit: int = 16) -> str:
        """One line per slot: its owner now and the last event that moved it."""
        slots = [int(s) for s in slots]
        lines = []
        for slot in slots[:limit]:
            if not 0 <= slot <= pool.capacity:
                lines.append(f"  {pool.name}[{slot}]: out of range 1..{pool.capacity}")
                continue
            owner = self.owners.describe(pool.owner_of(slot))
            ev = self.events.last_touching(pool.pool_id, slot)
            if ev is None:
                last = "no retained event"
            else:
                giver, receiver = ev.owners_of(slot)
                last = (
                    f"event #{ev.seq} {ev.reason}: {self.owners.describe(giver)}"
                    f" -> {self.owners.describe(receiver)}"
                )
            lines.append(f"  {pool.name}[{slot}] owned by {owner}; last {last}")
        if len(slots) > limit:
            lines.append(f"  ... and {len(slots) - limit} more")
        return "\n".join(lines)

    def name(self, owner: OwnerArg) -> str:
        if isinstance(owner, Owner):
            return str(owner)
        return ", ".join(sorted({self.owners.describe(int(o)) for o in np.unique(owner)}))

    def fault(self, pool: SlotPool, slots: Iterable[int], what: str) -> OwnershipError:
        """An error naming `what` went wrong and, slot by slot, who owns it and why."""
        slots = [int(s) for s in slots]
        return OwnershipError(
            f"pool {pool.name}: {what}: slots {slots}\n" + self.describe(pool, slots)
        )
