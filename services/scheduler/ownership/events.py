"""Ownership events: the record of every transfer, in the order the transfers happened.

An event is `(pool_id, slots, giver, receiver, reason)`; `slots` is an int or an int64
array, `giver`/`receiver` an owner id or an int64 array of owner ids that broadcasts
against `slots`. The log keeps them flat, five entries an event in one list: the hot
path's `flat.extend((...))` builds only a throwaway tuple (reused from the interpreter's
free list) and keeps no per-event object, where appending the tuple itself allocated one
per transfer and fed the garbage collector: a quarter of a Mamba slot alloc+free pair.
Drained events are regrouped into tuples (`RawEvent`) in C, or `Event` records. The
sequence number is the event's position in the log, so it costs nothing to assign.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

Slots = int | np.ndarray
OwnerIds = int | np.ndarray
RawEvent = tuple[int, Slots, OwnerIds, OwnerIds, str]
WIDTH = 5  # entries per event in the flat log


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


def _grouped(flat: list, start: int) -> list[RawEvent]:
    """The flat entries from `start` (a multiple of WIDTH) as one tuple per event. A slice,
    not `islice`: islice walks the retained window up to `start` on every drain."""
    it = iter(flat[start:])
    return list(zip(it, it, it, it, it, strict=True))


class EventLog:
    """Append-only log with a drain cursor and a bounded window kept for diagnostics.

    Writers extend `flat` with exactly WIDTH entries per event, in one call (atomic)."""

    def __init__(self, keep: int = 1 << 16) -> None:
        self.flat: list = []
        self._base = 0  # seq of the event at flat[0]
        self._cursor = 0  # index in flat of the first event not yet drained
        self._keep = keep * WIDTH  # in flat entries

    @property
    def raw(self) -> list[RawEvent]:
        """Every retained event as a tuple, oldest first (tests and diagnostics)."""
        return _grouped(self.flat, 0)

    @property
    def next_seq(self) -> int:
        return self._base + len(self.flat) // WIDTH

    def drain(self) -> list[Event]:
        """Events appended since the last drain, oldest first."""
        first, raw = self.drain_raw()
        return [Event(first + i, *ev) for i, ev in enumerate(raw)]

    def drain_raw(self) -> tuple[int, list[RawEvent]]:
        """(seq of the first, raw events) appended since the last drain."""
        start = self._cursor
        first, out = self._base + start // WIDTH, _grouped(self.flat, start)
        self._cursor = start + len(out) * WIDTH
        self._trim()
        return first, out

    def drain_count(self) -> int:
        """Mark everything drained without building records (for a consumer that reads raw)."""
        n = (len(self.flat) - self._cursor) // WIDTH
        self._cursor = len(self.flat)
        self._trim()
        return n

    def _trim(self) -> None:
        drop = min(self._cursor, len(self.flat) - self._keep)
        if drop > self._keep:  # amortised: trim only once a whole window is droppable
            del self.flat[:drop]
            self._base += drop // WIDTH
            self._cursor -= drop

    def last_touching(self, pool_id: int, slot: int) -> Event | None:
        """The newest retained event that moved `slot` of `pool_id` (diagnostics only)."""
        flat = self.flat
        for i in range(len(flat) - WIDTH, -1, -WIDTH):
            if flat[i] == pool_id:
                ev = Event(self._base + i // WIDTH, *flat[i : i + WIDTH])
                if ev.touches(slot):
                    return ev
        return None
