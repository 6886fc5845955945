"""Ships the ledger to the ownership stream: a snapshot at the start of an epoch (or on
request), then batches of events, and an `idle` marker with the scheduler's own counts.

Raw events are flattened to one record per moved slot, in ledger order, so the
consumer replays them in a tight loop. Sequence numbers are the shipper's own, per
epoch; a new scheduler process starts a new epoch with a snapshot.
"""

from __future__ import annotations

import secrets

import numpy as np

from services.scheduler.ownership.events import RawEvent
from services.scheduler.ownership.ledger import Ledger
from shared.wire import EventBatch, encode, pack_ints


class EventShipper:
    def __init__(self, ledger: Ledger, epoch: str | None = None) -> None:
        self.ledger = ledger
        self.epoch = epoch or secrets.token_hex(8)
        self.seq = 0

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def snapshot(self) -> bytes:
        """Every pool's owner table; events up to now are folded into it."""
        self.ledger.events.drain_count()
        self.ledger.owners.take_declared()
        owners = {o.id: str(o) for o in self.ledger.owners.live()}
        pools = [
            {
                "id": p.pool_id,
                "name": p.name,
                "capacity": p.capacity,
                "owners": pack_ints(p.owner_view),
            }
            for p in self.ledger.by_id
        ]
        body = {"pools": pools, "owners": owners, "next_event": self.ledger.events.next_seq}
        return encode("snapshot", self.epoch, self._next(), body)

    def batch(self) -> tuple[bytes, int] | None:
        """The events since the last call as one message, and how many; None if none."""
        first, raw = self.ledger.events.drain_raw()
        if not raw:
            return None
        batch = flatten(first, raw)
        batch.owners = {o.id: str(o) for o in self.ledger.owners.take_declared()}
        return encode("events", self.epoch, self._next(), batch.body()), len(raw)

    def sessions(self, records: list[dict], executor_epoch: str | None) -> bytes:
        """Durable session records; their slots are valid only on `executor_epoch`."""
        return encode(
            "sessions", self.epoch, self._next(), {"records": records, "executor": executor_epoch}
        )

    def idle(self, counts: dict[str, dict[str, int]]) -> bytes:
        return encode("idle", self.epoch, self._next(), {"counts": counts})


def flatten(first: int, raw: list[RawEvent]) -> EventBatch:
    reasons: list[str] = []
    chunks: list[tuple[np.ndarray, ...]] = []
    ev: list[int] = []
    pool: list[int] = []
    slot: list[int] = []
    giver: list[int] = []
    receiver: list[int] = []

    def flush() -> None:
        if ev:
            chunks.append(
                tuple(np.asarray(x, dtype=np.int64) for x in (ev, pool, slot, giver, receiver))
            )
            for x in (ev, pool, slot, giver, receiver):
                x.clear()

    for i, (p, s, g, r, reason) in enumerate(raw):
        reasons.append(reason)
        if isinstance(s, int):
            ev.append(i)
            pool.append(p)
            slot.append(s)
            giver.append(g)
            receiver.append(r)
        else:
            flush()
            n = len(s)
            chunks.append(
                (
                    np.full(n, i),
                    np.full(n, p),
                    s,
                    np.broadcast_to(g, (n,)),
                    np.broadcast_to(r, (n,)),
                )
            )
    flush()
    if not chunks:
        empty = np.zeros(0, dtype=np.int64)
        return EventBatch(first, reasons, empty, empty, empty, empty, empty)
    columns = [np.concatenate([c[k] for c in chunks]) for k in range(5)]
    return EventBatch(first, reasons, *columns)
