"""Feeds the router's prefix index (prefix_index.py) from the replicas' ownership streams.

Every router keeps its own index, so it reads with plain XREAD from the last entry it
saw, no consumer group. One loop per replica, each with its own blocking read: a read
over several streams would span slots on a Redis Cluster, and one replica's busy stream
delays no other's index. A loop starts at the stream's end, then asks for a snapshot
(`Keys.cache_snapshot_wanted`), so the snapshot comes after where it reads; it asks again
whenever its index is cleared (a gap, a new epoch), and again every `retry_seconds` while
no snapshot has come (one lost with a scheduler that died before shipping it).
Entries that are not the cache's (`k` = cache) are skipped undecoded.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from prometheus_client import Counter

from fronts.prefix_index import PrefixIndex, ReplicaIndex
from fronts.replicas import ReplicaTable
from shared import streams
from shared.messages.cache import CACHE_KIND
from shared.retry import Retry

log = logging.getLogger("custody.router")
READ_COUNT = 256


class PrefixFeed:
    def __init__(
        self,
        client: aioredis.Redis,
        table: ReplicaTable,
        index: PrefixIndex,
        block_ms: int = 1000,
        retry_seconds: float = 5.0,
    ) -> None:
        self.client, self.table, self.index = client, table, index
        self.block_ms, self.retry_seconds = block_ms, retry_seconds
        self.loops: dict[str, asyncio.Task] = {}

    async def run(self, faults: Counter | None = None) -> None:
        """Start a loop for every replica that registers, for as long as the router runs
        (a replica whose registration lapses keeps its loop: it may come back); their
        faults are counted in `faults`."""
        try:
            while True:
                for rid in self.table.live.keys() - self.loops.keys():
                    loop = self.follow(rid, faults)
                    self.loops[rid] = asyncio.create_task(loop, name=f"prefix-{rid}")
                await asyncio.sleep(self.table.period)
        finally:
            for loop in self.loops.values():
                loop.cancel()

    async def follow(self, replica: str, faults: Counter | None = None) -> None:
        """Read `replica`'s stream into its index, forever; a fault (counted, logged,
        shared/retry.py) clears the index and, after a backoff, starts over from the
        stream's end with a new snapshot."""
        keys, index = streams.Keys(replica), self.index.replica(replica)
        retry = Retry("prefix_feed", log, faults, about=f"replica {replica}")
        while True:
            try:
                await self._read(keys, index, retry)
            except Exception as err:
                index.clear()
                await retry.wait(err)

    async def _read(self, keys: streams.Keys, index: ReplicaIndex, retry: Retry) -> None:
        tail = await self.client.xrevrange(keys.ownership, count=1)
        last = tail[0][0] if tail else b"0-0"
        asked = await self._ask(keys)
        while True:
            reply = await self.client.xread(
                {keys.ownership: last}, count=READ_COUNT, block=self.block_ms
            )
            retry.ok()
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    if not fields or fields.get(b"k") != CACHE_KIND:
                        continue
                    if index.apply(fields.get(b"m", b"")):
                        asked = await self._ask(keys)
            if not index.ready and time.monotonic() - asked > self.retry_seconds:
                asked = await self._ask(keys)

    async def _ask(self, keys: streams.Keys) -> float:
        """Ask the replica's scheduler for a snapshot; returns when."""
        await self.client.set(keys.cache_snapshot_wanted, 1)
        return time.monotonic()
