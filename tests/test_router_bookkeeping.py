"""The router's bookkeeping (services/router/background.py) outlasts a Redis that
refuses writes: work refused by OOM is retried until Redis takes it, where it was given
up at the first refusal (a close's placement removal then stayed in the directory for
good, naming a session no replica holds)."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio as aioredis

from fronts.background import Background
from fronts.directory import Directory
from shared import streams
from shared.placement import Placement


def test_a_refused_placement_removal_is_retried_until_redis_takes_it(
    redis_url: str, redis_client: redis.Redis
) -> None:
    redis_client.set(streams.placement_key("s"), Placement("0").encode())
    redis_client.sadd(streams.Keys("0").placed, "s")
    saved = redis_client.config_get("maxmemory*")

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        background = Background()
        directory = Directory(client, lease_seconds=10)
        # the removal's own writes are not refused under OOM (DEL, SREM); a write that is
        # comes first, as a close's bookkeeping may (remembering a request, say)
        work = lambda: asyncio.gather(client.set("x", 1), directory.forget("s", "0"))  # noqa: E731
        redis_client.config_set("maxmemory-policy", "noeviction")
        redis_client.config_set("maxmemory", 1)
        try:
            background.run(work)
            await asyncio.sleep(0.6)
            assert background.retry.faults >= 1 and background.pending
        finally:
            redis_client.config_set("maxmemory", saved["maxmemory"])
            redis_client.config_set("maxmemory-policy", saved["maxmemory-policy"])
        await asyncio.wait(background.pending, timeout=10)
        assert not background.pending
        await client.aclose()

    asyncio.run(scenario())
    assert redis_client.get(streams.placement_key("s")) is None
    assert not redis_client.sismember(streams.Keys("0").placed, "s")
