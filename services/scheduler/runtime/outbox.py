"""The ownership outbox: every ownership message (ledger transfers, changed session
records, idle counts, snapshots) is numbered by the event shipper and kept here until
Redis has taken it. A send that fails (Redis restarting) is retried, never skipped: the
store would see a gap in the sequence (a resent message Redis had taken is a duplicate the
store drops). A step may ride along in the same round trip, after the ownership messages
(write-ahead: a slot a session released is never written by a published step before the
record saying so is on the ownership stream).

The prefix cache's messages for the routers (cache_shipper.py) go on the same stream in
the same round trip, marked with the field `k` = `cache` so the store skips them
undecoded; a router asks for a cache snapshot by setting `cache_snapshot_wanted`, which
is taken (deleted) once a heartbeat with the store's snapshot check."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from services.scheduler.engine.core import EngineCore
from services.scheduler.runtime.cache_shipper import CacheShipper
from services.scheduler.runtime.event_shipper import EventShipper
from shared import streams
from shared.messages.cache import CACHE_KIND

log = logging.getLogger("custody.scheduler")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class OwnershipOutbox:
    def __init__(
        self,
        engine: EngineCore,
        shipper: EventShipper,
        stream_maxlen: int,
        snapshot_check_seconds: float,
        keys: streams.Keys,
        cache: CacheShipper,
    ) -> None:
        self.engine = engine
        self.keys = keys
        self.shipper = shipper
        self.cache = cache
        self.stream_maxlen = stream_maxlen
        self.snapshot_check_seconds = snapshot_check_seconds
        self.messages: list[bytes] = []  # numbered, not yet on the stream
        self.cache_messages: list[bytes] = []  # the same, for the routers
        self.taken = 0  # passes that took the changed session records, so far
        self.shipped = 0  # the last such pass whose messages Redis has taken
        self._flushed = asyncio.Event()  # set (and replaced) at every flush
        self.trimmed_unread = 0  # ownership entries trimmed before the store read them
        self._was_idle = True
        self._next_snapshot_check = 0.0
        # whether this replica's lease lets it write session records (protocol/lives.py)
        self.may_record: Callable[[], bool] = lambda: True

    def queue_ownership(self, executor_epoch: str | None) -> bool:
        """The ledger's new transfers and the changed session records; False when the
        records were left (the lease lapsed: a session may have moved, and its record
        here must not reach the stream, nor its turn be acknowledged, before the
        directory is checked). Checked right before the flush that writes them, so a
        record on the stream was written while the lease held."""
        shipped = self.shipper.batch()
        if shipped is not None:
            self.messages.append(shipped[0])
        cache = self.cache.batch()
        if cache is not None:
            self.cache_messages.append(cache)
        if not self.may_record():
            return False
        records = self.engine.sessions.records.take_records()
        self.taken += 1
        if records:
            self.messages.append(self.shipper.sessions(records, executor_epoch))
        return True

    def queue_snapshot(self, executor_epoch: str | None) -> None:
        """The ledger's snapshot, then every open session's record (a full set): what a
        gap made the store lose is whole again. Not while the lease has lapsed
        (queue_ownership), nor while a restarted life waits to take back its sessions (it
        cannot name them all: the store would forget those whose records it had not
        applied yet); the store asks again. The store's proof does not wait for this
        full set: it needs only the earlier lives' entries (records_proof.py)."""
        self.messages.append(self.shipper.snapshot())
        sessions = self.engine.sessions
        if self.may_record() and not sessions.awaiting_records:
            records = sessions.records.all_records()
            self.messages.append(self.shipper.sessions(records, executor_epoch, True))

    def queue_cache_snapshot(self) -> None:
        self.cache_messages.append(self.cache.snapshot())

    async def queue_all(self, redis: aioredis.Redis, executor_epoch: str | None) -> bool:
        """Drain the ledger and, on becoming idle, take its counts, with no await in
        between: an API handler running during an await could move slots, and the idle
        counts would then be ahead of the events shipped before them; nor any await
        between taking the records and their flush, which follows (the lease is checked
        at the take). Once a heartbeat, first, a snapshot if the store asked for one, a
        cache snapshot if a router did. Returns whether the records were taken."""
        store_wants = routers_want = False
        if time.monotonic() >= self._next_snapshot_check:
            self._next_snapshot_check = time.monotonic() + self.snapshot_check_seconds
            pipe = redis.pipeline(transaction=False)  # one slot: the keys share a hash tag
            pipe.exists(self.keys.snapshot_wanted)
            pipe.delete(self.keys.cache_snapshot_wanted)
            store_wants, routers_want = await pipe.execute()
            await self.trim(redis)
        taken = self.queue_ownership(executor_epoch)
        idle = self.engine.idle
        if idle and not self._was_idle:
            self.messages.append(self.shipper.idle(self.engine.audit().counts))
        self._was_idle = idle
        if store_wants:
            self.queue_snapshot(executor_epoch)
        if routers_want:
            self.queue_cache_snapshot()
        return taken

    async def flush(self, redis: aioredis.Redis, step: bytes | None = None) -> None:
        """Every message not yet on the stream, in order, then `step` on the forward
        stream, in one round trip; a message leaves the outbox only once Redis took it."""
        carried = self.taken
        if not self.messages and not self.cache_messages and step is None:
            self._shipped(carried)  # the passes up to here took nothing: all is on the stream
            return
        pipe = redis.pipeline(transaction=False)
        stream = self.keys.ownership
        for message in self.messages:  # trimmed by `trim`, never past what the store read
            pipe.xadd(stream, {"m": message})
        for message in self.cache_messages:
            pipe.xadd(stream, {"k": CACHE_KIND, "m": message})
        if step is not None:
            pipe.xadd(self.keys.forward, {"m": step}, maxlen=self.stream_maxlen, approximate=True)
        await pipe.execute()
        self.messages.clear()
        self.cache_messages.clear()
        self._shipped(carried)

    async def trim(self, redis: aioredis.Redis) -> None:
        """Keep the ownership stream's newest `stream_maxlen` entries (what the routers
        read the prefix cache from) and every entry the store has not consumed (its
        group's oldest entry not acknowledged, else the last one it read): an entry
        trimmed before the store applied it is a gap only this life can fill. Past twice
        `stream_maxlen` unconsumed all the same (a store away that long), the oldest go,
        to bound Redis's memory: counted (`trimmed_unread`), logged, and marked
        (`Keys.trimmed_unread`) for the store to find the gap."""
        stream, cap = self.keys.ownership, self.stream_maxlen
        try:
            groups = await redis.xinfo_groups(stream)
        except ResponseError:
            return  # no stream yet
        store = next((g for g in groups if _text(g["name"]) == streams.STORE_GROUP), None)
        behind = None if store is None or store.get("lag") is None else store["lag"]
        if behind is not None and behind + store["pending"] <= cap:
            await redis.xtrim(stream, maxlen=cap, approximate=True)  # all consumed
            return
        if store is not None:
            pending = await redis.xpending(stream, streams.STORE_GROUP)
            keep = pending["min"] if pending["pending"] else store["last-delivered-id"]
            await redis.xtrim(stream, minid=_text(keep))
        removed = await redis.xtrim(stream, maxlen=2 * cap)
        if removed:
            first = await redis.xrange(stream, count=1)
            if first:
                await redis.set(self.keys.trimmed_unread, first[0][0])
            self.trimmed_unread += removed
            log.error(
                "replica %s: %d ownership entries trimmed before the session store read "
                "them (more than %d unconsumed): it will find a gap",
                self.keys.replica,
                removed,
                2 * cap,
            )

    def _shipped(self, carried: int) -> None:
        """What the passes up to `carried` took is on the stream: wake `durable`."""
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
