"""Ping-pong track slots of the `extra_buffer` strategy.

A running request snapshots its Mamba state at tracked lengths into one of two track
slots while the other keeps the previous snapshot, so a snapshot being written never
overwrites the one the prefix cache may take. Which entry is written next, which holds
the latest snapshot and at what length are fields of this one object, owned by the
request for its whole life; nothing about them lives loose on the request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.scheduler.ownership.errors import StaleHandle
from services.scheduler.ownership.owners import Owner
from services.scheduler.ownership.slot_pool import SlotPool


@dataclass(slots=True)
class Snapshot:
    slot: int
    seq_len: int


@dataclass(slots=True)
class PingPongTrack:
    pool: SlotPool
    owner: Owner  # track:<rid>
    slots: list[int]  # exactly two
    latest: int = -1  # entry holding the latest snapshot, -1 when there is none
    latest_len: int = 0

    def target(self) -> int:
        """The slot the next snapshot goes to: never the one holding the latest."""
        slot = self.slots[1 - self.latest if self.latest >= 0 else 0]
        if self.pool.owner_of(slot) != self.owner.id:
            raise StaleHandle(
                f"{self.owner} would snapshot into slot {slot} it no longer owns\n"
                + self.pool.ledger.describe(self.pool, [slot])
            )
        return slot

    def record(self, slot: int, seq_len: int) -> None:
        """The snapshot written to `slot` (a value `target()` returned) holds `seq_len`."""
        if slot not in self.slots:
            raise ValueError(f"{self.owner}: slot {slot} is not one of {self.slots}")
        if seq_len <= self.latest_len and self.latest >= 0:
            raise ValueError(f"{self.owner}: snapshot at {seq_len} after one at {self.latest_len}")
        self.latest = self.slots.index(slot)
        self.latest_len = seq_len

    def latest_snapshot(self) -> Snapshot | None:
        return None if self.latest < 0 else Snapshot(self.slots[self.latest], self.latest_len)

    def donate_latest(self, receiver: Owner, reason: str = "donate") -> Snapshot:
        """Move the latest snapshot's slot to `receiver` (a cache node: ownership moves,
        nothing is copied) and take a fresh slot in its place. All or nothing: if no slot
        is free, PoolExhausted is raised before anything moves."""
        snap = self.latest_snapshot()
        if snap is None:
            raise ValueError(f"{self.owner}: nothing to donate")
        replacement = self.pool.alloc_one(self.owner, "track_refill")
        self.pool.transfer_one(snap.slot, self.owner, receiver, reason)
        self.slots[self.latest] = replacement
        self.latest, self.latest_len = -1, 0
        return snap

    def claims(self) -> list[int]:
        return list(self.slots)

    def checked_slots(self) -> np.ndarray:
        """Both track slots, after checking this track still owns them."""
        slots = np.asarray(self.slots, dtype=np.int64)
        if not self.pool.owns(self.owner, slots):
            raise StaleHandle(
                f"{self.owner} lost a track slot it still lists\n"
                + self.pool.ledger.describe(self.pool, slots)
            )
        return slots
