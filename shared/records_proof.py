"""The proof that a replica's session records are current: the session store has applied
every session record its scheduler put on the ownership stream up to a given entry.

A reader of the records (a restarted scheduler taking its sessions back, a replica
taking a session over from another) first reads the stream's last entry id, then waits
until the store's `records_through` (written in the same transaction as the records,
services/session_store/consumer.py) has reached it. Records read after that are at least
as new as the last one written before the read began. Without the proof a reader never
guesses from older records: it answers 503 and tries again later."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from shared import streams

THROUGH = "records_through"  # field of `Keys.checkpoint`: an entry id, "0-0" at first
NO_STREAM = "0-0"


def entry_id(raw: bytes | str) -> tuple[int, int]:
    """A stream entry id as a comparable pair."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


async def stream_end(client: aioredis.Redis, keys: streams.Keys) -> str:
    """The id of the last entry on `keys`'s ownership stream, now."""
    tail = await client.xrevrange(keys.ownership, count=1)
    if not tail:
        return NO_STREAM
    last = tail[0][0]
    return last.decode() if isinstance(last, bytes) else last


async def records_through(client: aioredis.Redis, keys: streams.Keys) -> str:
    raw = await client.hget(keys.checkpoint, THROUGH)
    return NO_STREAM if raw is None else raw.decode()


async def records_current(client: aioredis.Redis, keys: streams.Keys, target: str) -> bool:
    """Whether every record up to entry `target` has been applied by the store."""
    if target == NO_STREAM:
        return True
    return entry_id(await records_through(client, keys)) >= entry_id(target)


async def wait_records_current(
    client: aioredis.Redis, keys: streams.Keys, target: str, timeout: float
) -> bool:
    """Poll `records_current` for up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not await records_current(client, keys, target):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True
