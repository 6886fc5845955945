"""The scheduler service's loop on a real Redis, in process: write-ahead of session
records, fencing, a step that cannot be encoded, and a fault that cannot be attributed.
No executor runs: the tests drive the loop's own methods and read the streams."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import redis

from services.scheduler.main import Scheduler
from services.scheduler.records.request import Request, Status
from services.scheduler.records.sampling import SamplingParams
from shared import streams
from shared.messages.cache import CACHE_KIND, CACHE_MESSAGES, CacheMessage, CacheSnapshot
from shared.messages.ownership import MESSAGES, OwnershipMessage, SessionRecords
from tests.services_harness import stack_settings


def ownership_messages(client: redis.Redis) -> list[OwnershipMessage]:
    entries = client.xrange(streams.SINGLE.ownership)
    return [MESSAGES.decode(f[b"m"]) for _, f in entries if f.get(b"k") != CACHE_KIND]


def cache_messages(client: redis.Redis) -> list[CacheMessage]:
    entries = client.xrange(streams.SINGLE.ownership)
    return [CACHE_MESSAGES.decode(f[b"m"]) for _, f in entries if f.get(b"k") == CACHE_KIND]


def started(url: str) -> Scheduler:
    loop = asyncio.get_event_loop()
    service = loop.run_until_complete(Scheduler.connect(stack_settings(url)))
    loop.run_until_complete(service.start())
    service.link.epoch = "executor-under-test"  # steps are published for it
    return service


def plain(rid: str, **params) -> Request:
    return Request(rid, np.arange(1, 9), SamplingParams(max_new_tokens=4, **params))


def test_a_released_sessions_record_is_on_the_stream_before_the_step_that_reuses_it(
    redis_url, redis_client
):
    """Write-ahead: the step planned right after a close is published together with the
    record of the close, the record first; a scheduler killed between them cannot
    rebuild the session on slots the step overwrites."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    service = started(redis_url)
    service.engine.sessions.open("gone")
    loop.run_until_complete(service.loop.ship_events())
    service.engine.sessions.close("gone")
    service.engine.submit(plain("r1"))
    plan = loop.run_until_complete(service.loop.publish_next())
    assert plan is not None and redis_client.xlen(streams.SINGLE.forward) == 1
    shipped = ownership_messages(redis_client)
    records = [r for m in shipped if isinstance(m, SessionRecords) for r in m.records]
    assert (records[-1].sid, records[-1].closed) == ("gone", True)
    loop.close()


def test_the_scheduler_announces_its_epoch_for_fencing(redis_url, redis_client):
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    first = started(redis_url)
    assert redis_client.get(streams.SINGLE.scheduler_epoch).decode() == first.outbox.shipper.epoch
    second = started(redis_url)
    assert redis_client.get(streams.SINGLE.scheduler_epoch).decode() == second.outbox.shipper.epoch
    loop.close()


def test_a_step_that_cannot_be_encoded_fails_only_its_requests(redis_url, redis_client):
    """A value msgpack cannot carry (a seed past 64 bits, were it ever let in) fails the
    requests of that step with a clear error and returns their slots; the loop goes on
    and the next request is served."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    service = started(redis_url)
    engine = service.engine
    bad = plain("bad")
    engine.submit(bad)
    bad.params = SamplingParams(max_new_tokens=4, seed=2**70)  # past the edge's checks
    assert loop.run_until_complete(service.loop.publish_next()) is None
    assert bad.status is Status.ABORTED and "could not be sent" in bad.finish_reason.message
    assert redis_client.xlen(streams.SINGLE.forward) == 0 and not engine.in_flight
    assert engine.check(idle=True).ok
    engine.submit(plain("good"))
    assert loop.run_until_complete(service.loop.publish_next()) is not None
    loop.close()


def test_a_fault_no_request_can_be_blamed_for_takes_the_device_lost_path(redis_url, redis_client):
    """An unexpected exception inside the loop: logged, counted, everything running is
    re-queued with its slots returned; the loop keeps running."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    service = started(redis_url)
    engine = service.engine
    req = plain("r1")
    engine.submit(req)
    loop.run_until_complete(service.loop.publish_next())
    calls = []

    async def broken_step() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise KeyError("a bug in completion")
        raise asyncio.CancelledError  # the second pass ends the test

    service.loop.step = broken_step
    with contextlib.suppress(asyncio.CancelledError):
        loop.run_until_complete(service.loop.run())
    assert service.loop.faults == 1 and len(calls) == 2
    assert req.status is Status.WAITING and not engine.in_flight  # re-queued
    assert engine.check().ok
    loop.close()


def test_the_prefix_cache_is_shipped_whole_at_start_and_when_a_router_asks(redis_url, redis_client):
    """The routers' snapshots ride the ownership stream marked `k` = cache, numbered
    apart from the store's messages; a router's request is taken (the key deleted)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    service = started(redis_url)
    (first,) = cache_messages(redis_client)
    assert isinstance(first, CacheSnapshot) and first.seq == 1 and first.ops == []
    assert first.epoch == service.outbox.shipper.epoch and first.block == 4
    redis_client.set(streams.SINGLE.cache_snapshot_wanted, 1)
    loop.run_until_complete(service.loop.ship_events())
    assert [m.seq for m in cache_messages(redis_client)] == [1, 2]
    assert not redis_client.exists(streams.SINGLE.cache_snapshot_wanted)
    assert ownership_messages(redis_client)  # the store's own, still all decodable
    loop.close()
