"""The router's table of replicas, on a real Redis: a replica keeps one object across
registration reads, so a request in flight while the table is read ends on the object
that counts it (a new object per read left +1 of load behind for every such request)."""

from __future__ import annotations

import asyncio
import json
import math
import time

import redis

from services.router.replicas import ReplicaTable
from shared import streams
from shared.redis_client import connect_async


def register(client: redis.Redis, rid: str, **load: int) -> None:
    entry = {"url": "http://r", "executor": True, "running": 0, "queued": 0, "sessions": 0}
    entry |= load | {"at": time.time(), "tenants": {}}
    client.sadd(streams.REPLICAS, rid)
    client.set(streams.Keys(rid).alive, json.dumps(entry))


def test_requests_and_opens_in_flight_across_a_read_end_where_they_count(
    redis_url: str, redis_client: redis.Redis
):
    async def scenario() -> None:
        table = ReplicaTable(await connect_async(redis_url), period=0.1)
        register(redis_client, "0")
        await table.refresh()
        replica = table.live["0"]
        replica.in_flight += 1  # a request sent ...
        opening = (math.inf, None)
        replica.placed.append(opening)  # ... and an open running
        register(redis_client, "0", running=1)
        await table.refresh()  # read while both are in flight
        assert table.live["0"] is replica and replica.running == 1
        replica.in_flight -= 1
        replica.placed.remove(opening)
        assert (table.live["0"].load, table.live["0"].sessions) == (1, 0)
        redis_client.delete(streams.Keys("0").alive)
        await table.refresh()
        assert "0" not in table.live
        register(redis_client, "0")
        await table.refresh()
        assert table.live["0"] is replica and replica.load == 0  # back: the same object
        await table.client.aclose()

    asyncio.run(scenario())
