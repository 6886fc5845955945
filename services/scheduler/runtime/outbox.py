"""The ownership outbox: every ownership message (ledger transfers, changed session
records, idle counts, snapshots) is numbered by the event shipper and kept here until
Redis has taken it. A send that fails (Redis restarting) is retried, never skipped: the
store would see a gap in the sequence (a resent message Redis had taken is a duplicate the
store drops). A step may ride along in the same round trip, after the ownership messages
(write-ahead: a slot a session released is never written by a published step before the
record saying so is on the ownership stream)."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from services.scheduler.engine.core import EngineCore
from services.scheduler.runtime.event_shipper import EventShipper
from shared import streams


class OwnershipOutbox:
    def __init__(
        self,
        engine: EngineCore,
        shipper: EventShipper,
        stream_maxlen: int,
        snapshot_check_seconds: float,
        keys: streams.Keys,
    ) -> None:
        self.engine = engine
        self.keys = keys
        self.shipper = shipper
        self.stream_maxlen = stream_maxlen
        self.snapshot_check_seconds = snapshot_check_seconds
        self.messages: list[bytes] = []  # numbered, not yet on the stream
        self.taken = 0  # passes that took the changed session records, so far
        self.shipped = 0  # the last such pass whose messages Redis has taken
        self._flushed = asyncio.Event()  # set (and replaced) at every flush
        self._was_idle = True
        self._next_snapshot_check = 0.0

    def queue_ownership(self, executor_epoch: str | None) -> None:
        """The ledger's new transfers and the changed session records."""
        shipped = self.shipper.batch()
        if shipped is not None:
            self.messages.append(shipped[0])
        records = self.engine.sessions.take_records()
        self.taken += 1
        if records:
            self.messages.append(self.shipper.sessions(records, executor_epoch))

    def queue_snapshot(self) -> None:
        self.messages.append(self.shipper.snapshot())

    async def queue_all(self, redis: aioredis.Redis, executor_epoch: str | None) -> None:
        """Drain the ledger and, on becoming idle, take its counts, with no await in
        between: an API handler running during an await could move slots, and the idle
        counts would then be ahead of the events shipped before them. Once a heartbeat,
        a snapshot if the store asked for one."""
        self.queue_ownership(executor_epoch)
        idle = self.engine.idle
        if idle and not self._was_idle:
            self.messages.append(self.shipper.idle(self.engine.audit().counts))
        self._was_idle = idle
        if time.monotonic() >= self._next_snapshot_check:
            self._next_snapshot_check = time.monotonic() + self.snapshot_check_seconds
            if await redis.exists(self.keys.snapshot_wanted):
                self.queue_snapshot()

    async def flush(self, redis: aioredis.Redis, step: bytes | None = None) -> None:
        """Every message not yet on the stream, in order, then `step` on the forward
        stream, in one round trip; a message leaves the outbox only once Redis took it."""
        if not self.messages and step is None:
            return
        carried = self.taken
        pipe = redis.pipeline(transaction=False)
        for message in self.messages:
            pipe.xadd(
                self.keys.ownership, {"m": message}, maxlen=self.stream_maxlen, approximate=True
            )
        if step is not None:
            pipe.xadd(self.keys.forward, {"m": step}, maxlen=self.stream_maxlen, approximate=True)
        await pipe.execute()
        self.messages.clear()
        self.shipped = carried
        self._flushed.set()
        self._flushed = asyncio.Event()

    async def durable(self) -> None:
        """Until every session record changed before this call is on the stream: a later
        pass takes it (takes and flushes run in the step loop, in that order), and its
        flush is done once `shipped` passes the mark. So an open or a close is answered
        only once a restarted scheduler would know it (while Redis is down, it waits)."""
        mark = self.taken
        while self.shipped <= mark:
            await self._flushed.wait()
