"""The scheduler's ownership outbox on a real Redis that restarts: a message whose send
failed is sent again, never skipped, so the session store sees no gap; a finished turn
is announced only once its record is on the stream."""

from __future__ import annotations

import asyncio

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError

from services.scheduler.main import Scheduler
from services.scheduler.ownership.owners import OwnerKind
from shared import streams
from shared.messages.cache import CACHE_KIND
from shared.messages.ownership import MESSAGES, SessionRecords
from shared.redis_server import PrivateRedis
from tests.services_harness import stack_settings


def sequence_numbers(url: str) -> list[int]:
    client = redis.Redis.from_url(url)
    try:
        entries = client.xrange(streams.SINGLE.ownership)
        return [MESSAGES.decode(f[b"m"]).seq for _, f in entries if f.get(b"k") != CACHE_KIND]
    finally:
        client.close()


def test_ownership_messages_survive_a_redis_restart_without_a_gap():
    with PrivateRedis(appendonly=True) as server:

        async def scenario() -> None:
            service = await Scheduler.connect(stack_settings(server.url))
            await service.start()
            pools = service.engine.pools
            owner = pools.ledger.new_owner(OwnerKind.REQUEST, "r1")
            slot = pools.mamba.alloc_one(owner)
            await service.loop.ship_events()
            server.stop()  # Redis goes away with events waiting to be shipped
            pools.mamba.free_one(slot, owner)
            with pytest.raises((RedisConnectionError, OSError)):
                await service.loop.ship_events()
            assert service.outbox.messages  # kept, numbered, for the next attempt
            server.start()
            await service.loop.ship_events()
            assert not service.outbox.messages
            await service.redis.aclose()
            await service.link.results.aclose()

        asyncio.run(scenario())
        seqs = sequence_numbers(server.url)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and len(seqs) >= 3


def recorded_sessions(url: str) -> list[str]:
    client = redis.Redis.from_url(url)
    try:
        entries = client.xrange(streams.SINGLE.ownership)
        messages = [MESSAGES.decode(f[b"m"]) for _, f in entries if f.get(b"k") != CACHE_KIND]
    finally:
        client.close()
    return [r.sid for m in messages if isinstance(m, SessionRecords) for r in m.records]


def test_an_open_or_a_close_is_answered_only_once_its_record_is_on_the_stream(redis_url):
    """`FrontDoor.durable` (what /open_session and /close_session await): not released
    by a flush that took the records before the change, released by the one after."""

    async def scenario() -> None:
        service = await Scheduler.connect(stack_settings(redis_url))
        await service.start()
        outbox, door = service.outbox, service.front_door
        outbox.queue_ownership(None)  # a pass takes the records, then ...
        session = door.open_session("s-durable", None, None)  # ... the session opens
        waiting = asyncio.ensure_future(door.durable())
        await outbox.flush(service.redis)  # the pass taken before the open
        await asyncio.sleep(0.01)
        assert not waiting.done() and session.sid not in recorded_sessions(redis_url)
        await service.loop.ship_events()  # a pass after the open, and its flush
        await asyncio.wait_for(waiting, 5)
        assert recorded_sessions(redis_url).count(session.sid) == 1
        await door.close_session(session)
        closing = asyncio.ensure_future(door.durable())
        await asyncio.sleep(0.01)
        assert not closing.done()  # no pass has taken the close yet
        await service.loop.ship_events()
        await asyncio.wait_for(closing, 5)
        assert recorded_sessions(redis_url).count(session.sid) == 2
        await service.redis.aclose()
        await service.link.results.aclose()

    asyncio.run(scenario())


def test_durable_returns_when_a_later_pass_has_nothing_to_send(redis_url):
    """A wait for records that are already on the stream (a migration's, after its tier
    moves shipped them) ends with the next pass even when that pass takes nothing: it
    used to wait for unrelated traffic to flush something."""

    async def scenario() -> None:
        service = await Scheduler.connect(stack_settings(redis_url))
        await service.start()
        await service.loop.ship_events()  # everything so far is on the stream
        waiting = asyncio.ensure_future(service.front_door.durable())
        await asyncio.sleep(0.01)
        await service.loop.ship_events()  # a pass that takes nothing, and its flush
        await asyncio.wait_for(waiting, 5)
        await service.redis.aclose()
        await service.link.results.aclose()

    asyncio.run(scenario())
