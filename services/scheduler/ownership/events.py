"""Ownership events: the record of every transfer, in the order the transfers happened.

The hot path appends a bare tuple `(pool_id, slots, giver, receiver, reason)`; `slots` is
an int or an int64 array, `giver`/`receiver` an owner id or an int64 array of owner ids
that broadcasts against `slots`. The sequence number is the event's position in the log,
so it costs nothing to assign. Drained events become `Event` records for shipping.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

Slots = int | np.ndarray
OwnerIds = int | np.ndarray
RawEvent = tuple[int, Slots, OwnerIds, OwnerIds, str]


class Event(NamedTuple):
    seq: int
    pool: int
    slots: Slots
    giver: OwnerIds
    receiver: OwnerIds
    reason: str

    def touches(self, slot: int) -> bool:
        return bool(np.any(np.asarray(self.slots) == slot))

    def owners_of(self, slot: int) -> tuple[int, int]:
        """(giver, receiver) ids for one slot of this event."""
        slots = np.atleast_1d(self.slots)
        i = int(np.flatnonzero(slots == slot)[0])
        pick = lambda ids: int(np.broadcast_to(ids, slots.shape)[i])  # noqa: E731
        return pick(self.giver), pick(self.receiver)


class EventLog:
    """Append-only log with a drain cursor and a bounded window kept for diagnostics."""

    def __init__(self, keep: int = 1 << 16) -> None:
        self.raw: list[RawEvent] = []
        self._base = 0  # seq of raw[0]
        self._cursor = 0  # index in raw of the first event not yet drained
        self._keep = keep

    @property
    def next_seq(self) -> int:
        return self._base + len(self.raw)

    def drain(self) -> list[Event]:
        """Events appended since the last drain, oldest first."""
        raw, start = self.raw, self._cursor
        out = [Event(self._base + i, *raw[i]) for i in range(start, len(raw))]
        self._cursor = len(raw)
        self._trim()
        return out

    def drain_raw(self) -> tuple[int, list[RawEvent]]:
        """(seq of the first, raw events) appended since the last drain."""
        start = self._cursor
        first, out = self._base + start, self.raw[start:]
        self._cursor = len(self.raw)
        self._trim()
        return first, out

    def drain_count(self) -> int:
        """Mark everything drained without building records (for a consumer that reads raw)."""
        n = len(self.raw) - self._cursor
        self._cursor = len(self.raw)
        self._trim()
        return n

    def _trim(self) -> None:
        drop = min(self._cursor, len(self.raw) - self._keep)
        if drop > self._keep:  # amortised: trim only once a whole window is droppable
            del self.raw[:drop]
            self._base += drop
            self._cursor -= drop

    def last_touching(self, pool_id: int, slot: int) -> Event | None:
        """The newest retained event that moved `slot` of `pool_id` (diagnostics only)."""
        for i in range(len(self.raw) - 1, -1, -1):
            ev = Event(self._base + i, *self.raw[i])
            if ev.pool == pool_id and ev.touches(slot):
                return ev
        return None
