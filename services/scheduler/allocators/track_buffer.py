"""Track slots of the `extra_buffer` strategy.

A running request snapshots its Mamba state at tracked lengths into one of its track
slots while another keeps the previous snapshot, so a snapshot being written never
overwrites the one the prefix cache may take. It has one more than the pipeline's depth
(two at depth 0 or 1, ping-pong; three at depth 2): the latest snapshot, and one for
each step in flight, so that every step may take its snapshot. The snapshot the latest
replaced stays readable (`prior`) until a later step writes over its entry: a chat turn
whose latest snapshot lies inside a page, at its reply's start, still has the
page-aligned one before it for the prefix cache (docs/ownership.md, "Kept boundaries").
Which entry is written next, which hold the latest and prior snapshots and at what
lengths are fields of this one object, owned by the request for its whole life; nothing
about them lives loose on the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.scheduler.ownership.errors import StaleHandle
from services.scheduler.ownership.owners import Owner
from services.scheduler.ownership.slot_pool import SlotPool


@dataclass(slots=True)
class Snapshot:
    slot: int
    seq_len: int


@dataclass(slots=True)
class TrackSlots:
    pool: SlotPool
    owner: Owner  # track:<rid>
    slots: list[int]  # at least two
    latest: int = -1  # entry holding the latest recorded snapshot, -1 when none
    latest_len: int = 0
    prior: int = -1  # entry holding the snapshot the latest replaced, -1 when none
    prior_len: int = 0
    pending: list[int] = field(default_factory=list)  # entries steps in flight are writing

    def begin_snapshot(self) -> int | None:
        """The slot a step about to be planned may write a snapshot into: neither the one
        holding the latest snapshot nor one a step in flight is writing. None when both
        are taken (the step then takes no snapshot; only a cache opportunity is lost). The
        prior snapshot's entry is written over last."""
        free = [e for e in range(len(self.slots)) if e not in self.pending and e != self.latest]
        if not free:
            return None
        entry = next((e for e in free if e != self.prior), free[0])
        if entry == self.prior:
            self.prior, self.prior_len = -1, 0
        slot = self.slots[entry]
        if self.pool.owner_of(slot) != self.owner.id:
            raise StaleHandle(
                f"{self.owner} would snapshot into slot {slot} it no longer owns\n"
                + self.pool.ledger.describe(self.pool, [slot])
            )
        self.pending.append(entry)
        return slot

    def can_snapshot(self) -> bool:
        """Whether `begin_snapshot` would give a slot now."""
        return any(e not in self.pending and e != self.latest for e in range(len(self.slots)))

    def record(self, slot: int, seq_len: int) -> None:
        """The step that wrote `slot` (a value `begin_snapshot` gave) has run: the
        snapshot there, at `seq_len`, is now the latest. The length comes from the step
        that was planned, never from the request's current length (lesson 9)."""
        entry = self._pending_entry(slot)
        if entry is None:
            raise ValueError(f"{self.owner}: slot {slot} was not being written")
        if self.latest >= 0 and seq_len <= self.latest_len:
            raise ValueError(f"{self.owner}: snapshot at {seq_len} after one at {self.latest_len}")
        self.pending.remove(entry)
        if self.latest >= 0:
            self.prior, self.prior_len = self.latest, self.latest_len
        self.latest, self.latest_len = entry, seq_len

    def cancel(self, slot: int) -> None:
        """The step that was to write `slot` will not count."""
        entry = self._pending_entry(slot)
        if entry is not None:
            self.pending.remove(entry)

    def _pending_entry(self, slot: int) -> int | None:
        return next((e for e in self.pending if self.slots[e] == slot), None)

    def latest_snapshot(self) -> Snapshot | None:
        return None if self.latest < 0 else Snapshot(self.slots[self.latest], self.latest_len)

    def deepest_on_page(self, page_size: int) -> Snapshot | None:
        """The latest snapshot at a page boundary, the prior one when the latest is not:
        what the prefix cache can take (its nodes end on pages)."""
        for entry, length in ((self.latest, self.latest_len), (self.prior, self.prior_len)):
            if entry >= 0 and length % page_size == 0:
                return Snapshot(self.slots[entry], length)
        return None

    def donate_latest(self, receiver: Owner, reason: str = "donate") -> Snapshot:
        """`donate` the latest snapshot (a chat turn's reply start, to its session)."""
        snap = self.latest_snapshot()
        if snap is None:
            raise ValueError(f"{self.owner}: nothing to donate")
        return self.donate(snap, receiver, reason)

    def donate(self, snap: Snapshot, receiver: Owner, reason: str = "donate") -> Snapshot:
        """Move the slot of `snap` (the latest or the prior snapshot) to `receiver` (a
        cache node, a session: ownership moves, nothing is copied) and take a fresh slot
        in its place. All or nothing: if no slot is free, PoolExhausted is raised before
        anything moves."""
        entry = self.slots.index(snap.slot)
        if entry not in (self.latest, self.prior):
            raise ValueError(f"{self.owner}: slot {snap.slot} holds no snapshot")
        replacement = self.pool.alloc_one(self.owner, "track_refill")
        self.pool.transfer_one(snap.slot, self.owner, receiver, reason)
        self.slots[entry] = replacement
        if entry == self.latest:
            self.latest, self.latest_len = -1, 0
        else:
            self.prior, self.prior_len = -1, 0
        return snap

    def claims(self) -> list[int]:
        return list(self.slots)

    def checked_slots(self) -> np.ndarray:
        """The track slots, after checking this track still owns them."""
        slots = np.asarray(self.slots, dtype=np.int64)
        if not self.pool.owns(self.owner, slots):
            raise StaleHandle(
                f"{self.owner} lost a track slot it still lists\n"
                + self.pool.ledger.describe(self.pool, slots)
            )
        return slots
