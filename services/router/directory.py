"""Where a session lives and where a request runs, in Redis, so that every router (a
restarted one, a second one) sends a session's turns to the same replica.

A session's placement is written when it is opened, before the replica is asked, with
a single-key `SET NX`: of two routers opening the same id at once, one placement wins
and both send the open there (the replica answers the second with its own conflict).
It is removed when the session is closed. Each replica's sessions are also listed in a
set under its own tag (`Keys.placed`), which a drain or a re-homing walks; a move
changes the placement only if it is still where the mover found it (a compare-and-set,
one key), so two routers cannot both move a session. A request's replica is kept for an hour, for
`/abort_request` by rid; it is keyed by the caller's tenant too, as the replicas key rids."""

from __future__ import annotations

import redis.asyncio as aioredis

from shared import streams

REQUEST_TTL_SECONDS = 3600
MOVE = """if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2])
  return 1
end
return 0"""


class Directory:
    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self._move = client.register_script(MOVE)

    async def session(self, sid: str) -> str | None:
        raw = await self.client.get(streams.placement_key(sid))
        return None if raw is None else raw.decode()

    async def place(self, sid: str, replica: str) -> tuple[str, bool]:
        """(the replica the session is placed on, whether this call placed it)."""
        key = streams.placement_key(sid)
        if await self.client.set(key, replica, nx=True):
            await self.client.sadd(streams.Keys(replica).placed, sid)
            return replica, True
        raw = await self.client.get(key)
        if raw is None:  # removed in between (a close): place it again
            return await self.place(sid, replica)
        return raw.decode(), False

    async def forget(self, sid: str, replica: str) -> None:
        await self.client.delete(streams.placement_key(sid))
        await self.client.srem(streams.Keys(replica).placed, sid)

    async def move(self, sid: str, source: str, target: str) -> bool:
        """Place `sid` on `target` if it is still placed on `source`."""
        if not await self._move(keys=[streams.placement_key(sid)], args=[source, target]):
            return False
        await self.client.sadd(streams.Keys(target).placed, sid)
        await self.client.srem(streams.Keys(source).placed, sid)
        return True

    async def placed_on(self, replica: str) -> list[str]:
        return sorted(m.decode() for m in await self.client.smembers(streams.Keys(replica).placed))

    async def remember_request(self, tenant: str, rid: str, replica: str) -> None:
        key = streams.request_key(f"{tenant}:{rid}")
        await self.client.set(key, replica, ex=REQUEST_TTL_SECONDS)

    async def request(self, tenant: str, rid: str) -> str | None:
        raw = await self.client.get(streams.request_key(f"{tenant}:{rid}"))
        return None if raw is None else raw.decode()
