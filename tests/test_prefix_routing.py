"""Prefix-aware routing on a real Redis: the router's feed follows a replica's stream
from its end, asks for a snapshot and again after a gap; and with two replicas as
processes, requests sharing a long prompt go to the replica that caches it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis

from custody.up import Stack
from fronts.prefix_feed import PrefixFeed
from fronts.prefix_index import PrefixIndex
from fronts.replicas import Replica, ReplicaTable
from shared import streams
from shared.messages.cache import CACHE_KIND, CacheEvents, CacheSnapshot, Stored, chain
from shared.messages.envelope import encode
from tests.services_harness import call, metrics, stack_settings, start_stack

PROMPT = list(range(40))
TRACK = 8  # POOLS' track_interval: a cached prefix ends at a multiple of it


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def cache_entry(message: CacheSnapshot | CacheEvents) -> dict:
    return {"k": CACHE_KIND, "m": encode(message)}


def test_the_feed_reads_from_the_end_asks_for_snapshots_and_skips_other_entries(
    redis_url: str, redis_client: redis.Redis
):
    keys, node = streams.Keys("7"), Stored(5, 0, chain(PROMPT[:32], 4))
    stale = CacheSnapshot(epoch="old", seq=1, block=4, ops=[node])
    redis_client.xadd(keys.ownership, cache_entry(stale))  # before the router: never read

    async def scenario() -> None:
        client = aioredis.from_url(redis_url)
        table = ReplicaTable(client, 0.05)
        table.live = {"7": Replica("7", "http://x", True, 0, 0, 0, "e", warmed="e")}
        index = PrefixIndex()
        feed = PrefixFeed(client, table, index, block_ms=50, retry_seconds=0.5)
        task = asyncio.create_task(feed.run())
        try:
            await until(lambda: redis_client.exists(keys.cache_snapshot_wanted))
            redis_client.delete(keys.cache_snapshot_wanted)  # as the scheduler takes it
            redis_client.xadd(keys.ownership, {"m": b"the store's, not decoded"})
            redis_client.xadd(
                keys.ownership, cache_entry(CacheSnapshot(epoch="e", seq=4, block=4, ops=[]))
            )
            redis_client.xadd(
                keys.ownership, cache_entry(CacheEvents(epoch="e", seq=5, ops=[node]))
            )
            await until(lambda: index.match(PROMPT, ["7"]) == {"7": 32})
            assert index.replicas["7"].gaps == 0
            redis_client.xadd(keys.ownership, cache_entry(CacheEvents(epoch="e", seq=7, ops=[])))
            await until(lambda: redis_client.exists(keys.cache_snapshot_wanted))  # the gap
            assert index.match(PROMPT, ["7"]) == {} and index.replicas["7"].gaps == 1
            redis_client.delete(keys.cache_snapshot_wanted)  # taken, but never shipped
            await until(lambda: redis_client.exists(keys.cache_snapshot_wanted), 2.0)
        finally:
            task.cancel()
            await client.aclose()

    asyncio.run(scenario())


@pytest.fixture
def two(redis_url: str, redis_client: redis.Redis) -> Stack:
    running = start_stack(stack_settings(redis_url, replicas=2))
    yield running
    running.stop()


def generate(port: int, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    return call(port, "/generate", body)


def holder_of_blocks(port: int, timeout: float = 10.0) -> str:
    """The one replica the router's index shows caching something."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        blocks = {
            dict(labels)["replica"]: value
            for (name, labels), value in metrics(port).items()
            if name == "custody_router_prefix_blocks" and value > 0
        }
        if blocks:
            (replica,) = blocks
            return replica
        time.sleep(0.05)
    raise AssertionError("the router's index never showed the cached prompt")


def test_requests_sharing_a_prompt_go_to_the_replica_that_caches_it(two: Stack):
    port, rng = two.settings.port, np.random.default_rng(5)
    prompt = rng.integers(0, 256, 256).tolist()
    assert generate(port, prompt)["meta_info"]["cached_tokens"] == 0
    holder = holder_of_blocks(port)
    for _ in range(6):
        reply = generate(port, prompt + rng.integers(0, 256, 16).tolist())
        assert reply["meta_info"]["cached_tokens"] >= len(prompt) - TRACK, reply["meta_info"]
    samples = metrics(port)
    routed = {
        (dict(labels)["decision"], dict(labels)["replica"]): value
        for (name, labels), value in samples.items()
        if name == "custody_router_requests_total"
    }
    assert routed[("prefix", holder)] == 6 and ("prefix", str(1 - int(holder))) not in routed
    assert sum(routed.values()) == 7  # the first by load
    tokens = samples[("custody_router_prefix_tokens_total", (("replica", holder),))]
    assert tokens >= 6 * (len(prompt) - TRACK)
