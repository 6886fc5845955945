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
from shared.messages.envelope import array, encode
from shared.messages.ownership import (
    OWNER,
    Events,
    Idle,
    PoolTable,
    SessionRecord,
    SessionRecords,
    Snapshot,
    Transfers,
)


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
        pools = [
            PoolTable(
                id=p.pool_id, name=p.name, capacity=p.capacity, owners=array(p.owner_view, OWNER)
            )
            for p in self.ledger.by_id
        ]
        return encode(
            Snapshot(
                epoch=self.epoch,
                seq=self._next(),
                pools=pools,
                owners={o.id: str(o) for o in self.ledger.owners.live()},
                next_event=self.ledger.events.next_seq,
            )
        )

    def batch(self) -> tuple[bytes, int] | None:
        """The events since the last call as one message, and how many; None if none."""
        first, raw = self.ledger.events.drain_raw()
        if not raw:
            return None
        reasons, records = flatten(raw)
        owners = {o.id: str(o) for o in self.ledger.owners.take_declared()}
        message = Events.of(self.epoch, self._next(), first, reasons, records, owners)
        return encode(message), len(raw)

    def sessions(
        self,
        records: list[SessionRecord],
        executor_epoch: str | None,
        full: bool = False,
    ) -> bytes:
        """Durable session records; their slots are valid only on `executor_epoch`.
        `full`: every open session's (the store forgets any other)."""
        return encode(
            SessionRecords(
                epoch=self.epoch,
                seq=self._next(),
                records=records,
                executor=executor_epoch,
                full=full,
            )
        )

    def idle(self, counts: dict[str, dict[str, int]]) -> bytes:
        return encode(Idle(epoch=self.epoch, seq=self._next(), counts=counts))


def flatten(raw: list[RawEvent]) -> tuple[list[str], Transfers]:
    """Per event its reason, and the transfers as one record per moved slot."""
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
        return reasons, Transfers(empty, empty, empty, empty, empty)
    return reasons, Transfers(*(np.concatenate([c[k] for c in chunks]) for k in range(5)))
