"""A Redis key that says one process is doing a piece of work (a router re-homing a dead
replica's sessions), held under a short lease its holder renews while the work runs.

A lock taken with a long fixed expiry outlives any holder that cannot delete it: one
killed mid-work, or one whose `DEL` Redis refused (a read-only window after a failover).
Every process that waits for the key to go (the dead replica's scheduler, fenced until it
may check its sessions) then waits out the whole expiry. Under a lease the key goes
within one lease of its holder's end, whatever ended it. The key holds its holder's
token, so a holder renews and releases only its own key, never one a later holder took
after its lease ran out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from shared.retry import DEPENDENCY_FAULTS

log = logging.getLogger("custody.key_lease")
RENEW = """if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0"""
RELEASE = """if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0"""


class KeyLease:
    def __init__(self, client: aioredis.Redis, key: str, seconds: float) -> None:
        self.client, self.key = client, key
        self.ms = max(int(seconds * 1000), 1)
        self.token = secrets.token_hex(8)
        self._renew = client.register_script(RENEW)
        self._release = client.register_script(RELEASE)

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[bool]:
        """Take the key if nobody holds it; yields whether it was taken. While the body
        runs the lease is renewed every third of it; after, the key is released (if
        Redis refuses, it expires within one lease)."""
        if not await self.client.set(self.key, self.token, nx=True, px=self.ms):
            yield False
            return
        renewing = asyncio.ensure_future(self._keep())
        try:
            yield True
        finally:
            renewing.cancel()
            try:
                await self._release(keys=[self.key], args=[self.token])
            except DEPENDENCY_FAULTS as err:
                log.warning("%s not released (it expires within its lease): %s", self.key, err)

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(self.ms / 3000)
            try:
                if not await self._renew(keys=[self.key], args=[self.token, self.ms]):
                    log.warning("%s: lease lost while its work runs", self.key)
                    return
            except DEPENDENCY_FAULTS as err:
                log.warning("%s: lease not renewed, retried: %s", self.key, err)
