"""The re-homing key's lease (shared/key_lease.py), on a real Redis: held past its lease
while the work runs, gone within one lease of a holder that died or whose release Redis
refused, and never renewed or released by a holder whose lease another took over."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import redis
import redis.asyncio as aioredis

from shared.key_lease import KeyLease
from shared.redis_server import free_port

LEASE = 0.3


async def key_gone_within(client: aioredis.Redis, key: str, seconds: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while loop.time() < deadline:
        if not await client.exists(key):
            return True
        await asyncio.sleep(0.02)
    return False


def test_one_holder_at_a_time_renewed_while_it_works_released_after(
    redis_url: str, redis_client: redis.Redis
):
    async def run() -> None:
        client = aioredis.Redis.from_url(redis_url)
        first, second = KeyLease(client, "work", LEASE), KeyLease(client, "work", LEASE)
        async with first.held() as mine:
            assert mine
            await asyncio.sleep(3 * LEASE)  # three leases: renewed, still held
            async with second.held() as theirs:
                assert not theirs
            assert await client.get("work") == first.token.encode()
        assert not await client.exists("work")
        await client.aclose()

    asyncio.run(run())


HOLD_FOREVER = """
import asyncio, sys
import redis.asyncio as aioredis
from shared.key_lease import KeyLease

async def main():
    client = aioredis.Redis.from_url(sys.argv[1])
    async with KeyLease(client, "work", float(sys.argv[2])).held() as mine:
        print(mine, flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_a_holder_killed_holding_the_key_frees_it_within_one_lease(
    redis_url: str, redis_client: redis.Redis
):
    """A router SIGKILLed mid-work: its renewals stop and nobody deletes the key."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_FOREVER, redis_url, str(LEASE)], stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"True"
        time.sleep(2 * LEASE)
        assert redis_client.exists("work")  # renewed past its first lease
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 2 * LEASE
    while redis_client.exists("work") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not redis_client.exists("work")


def test_a_refused_release_leaves_the_key_to_expire_not_to_outlive_the_work(
    redis_url: str, redis_client: redis.Redis
):
    """Redis read-only as the work ends (after a failover): the release is refused,
    logged, and the key still goes within one lease."""

    async def run() -> None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            async with KeyLease(client, "work", LEASE).held() as mine:
                assert mine
                await client.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
            assert await client.exists("work")
            assert await key_gone_within(client, "work", 3 * LEASE)
        finally:
            await client.execute_command("REPLICAOF", "NO", "ONE")
            await client.aclose()

    asyncio.run(run())


def test_a_holder_whose_lease_lapsed_neither_renews_nor_releases_the_next_holder_s_key(
    redis_url: str, redis_client: redis.Redis
):
    async def run() -> None:
        client = aioredis.Redis.from_url(redis_url)
        late = KeyLease(client, "work", LEASE)
        async with late.held() as mine:
            assert mine
            await client.set("work", "the next holder's token")  # its lease ran out
            await asyncio.sleep(LEASE)  # a renewal comes due, and must not touch it
            assert await client.ttl("work") == -1
        assert await client.get("work") == b"the next holder's token"
        await client.aclose()

    asyncio.run(run())
