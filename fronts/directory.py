"""Where a session lives and where a request runs, in Redis, so that every router (a
restarted one, a second one) sends a session's turns to the same replica.

A session's placement (`shared.placement.Placement`) is written when it is opened, before
the replica is asked, with a single-key `SET NX`: of two routers opening the same id at
once, one placement wins and both send the open there (the replica answers the second
with its own conflict). It is removed when the session is closed. Each replica's
sessions are also listed in a set under its own tag (`Keys.placed`), which a drain or a
re-homing walks. A close's placement is removed just after the close is answered (a turn
in between finds the session closed on its replica).

A move changes the placement by compare-and-set only (one key, a Lua script): into
transit from exactly the placement the mover read, out of transit to the target at the
next epoch (commit) or back to the source (abort). So two routers never both move a
session, and a move whose router died is finished or undone by another, never both. The
move is listed in `streams.MOVES` first, under a lease its router renews while it works.
A request's replica is kept for an hour, for `/abort_request` by rid; it is keyed by the
caller's tenant too, as the replicas key rids.

Each front also remembers the placements it read or wrote, so a turn costs it no Redis
round trip, and keeps that memory current: every placement write publishes the key and
its new value (`streams.PLACEMENT_CHANGES`, from the same Lua script or pipeline as the
write), and `follow_changes` applies them in order. Memory answers (`remembered`) only
while that subscription is live and answered within `HEARD_SECONDS`; otherwise the
directory is read. A read or write whose answer crosses a notice is not remembered (the
notice, newer, is). A notice still on its way when a turn is sent leaves that turn at a
replica that no longer holds the session: it answers 404 or 503, and the router, which
can try again, reads the directory and does (fronts/decision.py, `Pick.remembered`)."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import redis.asyncio as aioredis
from prometheus_client import Counter

from shared import streams
from shared.placement import UNPLACE, Move, Placement
from shared.retry import Retry

log = logging.getLogger("custody.router")
REQUEST_TTL_SECONDS = 3600
HEARD_SECONDS = 2.0  # a subscription silent this long, though pinged, is taken as lost
REMEMBERED = 1 << 17  # placements a router remembers; the oldest read is forgotten first
# a compare-and-set that finds the key already at its new value answers done: redis-py
# sends a command again after a connection error, so a swap whose reply was lost runs
# twice, and the second, answering "not swapped", left a begun move unlisted for good
SWAP = f"""local value = redis.call('GET', KEYS[1])
if value == ARGV[2] then
  return 1
end
if value == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2])
  redis.call('PUBLISH', '{streams.PLACEMENT_CHANGES}', KEYS[1] .. ' ' .. ARGV[2])
  return 1
end
return 0"""
PLACE = f"""if redis.call('SET', KEYS[1], ARGV[1], 'NX') then
  redis.call('PUBLISH', '{streams.PLACEMENT_CHANGES}', KEYS[1] .. ' ' .. ARGV[1])
  return 1
end
return 0"""
TAKE_OVER = """local lease = redis.call('ZSCORE', KEYS[1], ARGV[1])
if lease and tonumber(lease) <= tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
  return 1
end
return 0"""


class Directory:
    def __init__(self, client: aioredis.Redis, lease_seconds: float) -> None:
        self.client, self.lease_seconds = client, lease_seconds
        self._swap = client.register_script(SWAP)
        self._unplace = client.register_script(UNPLACE)
        self._place = client.register_script(PLACE)
        self._take_over = client.register_script(TAKE_OVER)
        self._seen: dict[str, Placement] = {}
        self._hearing = False  # subscribed to the change notices: `_seen` is current
        self._last_heard = -math.inf  # when the subscription last answered (monotonic)
        self._notices = 0  # change notices heard, and subscriptions made

    def _saw(self, sid: str, placement: Placement | None, since: int) -> Placement | None:
        """Remember `placement`, read or written when `since` notices had been heard,
        unless a notice came meanwhile: then the notices, newer, say what it is."""
        if since == self._notices:
            self._remember(sid, placement)
        return placement

    def _remember(self, sid: str, placement: Placement | None) -> None:
        self._seen.pop(sid, None)
        if placement is not None:
            self._seen[sid] = placement
            if len(self._seen) > REMEMBERED:
                del self._seen[next(iter(self._seen))]

    async def session(self, sid: str) -> Placement | None:
        """`sid`'s placement, read from the directory."""
        since = self._notices
        raw = await self.client.get(streams.placement_key(sid))
        return self._saw(sid, Placement.decode(raw), since)

    def hearing(self) -> bool:
        """Subscribed, and the subscription answered lately: a connection that died
        without a word (a partition) stops the trust within `HEARD_SECONDS`."""
        return self._hearing and time.monotonic() - self._last_heard < HEARD_SECONDS

    def remembered(self, sid: str) -> Placement | None:
        """`sid`'s placement from memory, only while this directory hears every change
        (`follow_changes`): exact but for a notice still on its way."""
        return self._seen.get(sid) if self.hearing() else None

    async def current(self, sid: str) -> Placement | None:
        """`sid`'s placement: the one remembered while this directory hears every change
        (`follow_changes`), else read. Exact but for a notice still on its way: a turn
        sent then meets the replica's own check (a session it no longer holds)."""
        return self.remembered(sid) or await self.session(sid)

    async def follow_changes(self, faults: Counter | None = None) -> None:
        """Hear every placement write (each publishes its key and new value on
        `streams.PLACEMENT_CHANGES`, in the order Redis ran them) and keep what is
        remembered as written, forever. It is trusted only while subscribed: cleared at
        each subscription (what changed before it was not heard), and a lost connection,
        or one silent past `HEARD_SECONDS` though pinged, stops the trust until the next.
        A client without pub/sub (a cluster client) never subscribes: every `current`
        reads."""
        if not hasattr(self.client, "pubsub"):
            return
        retry = Retry("placement_changes", log, faults)
        while True:
            pubsub = self.client.pubsub()
            try:
                await pubsub.subscribe(streams.PLACEMENT_CHANGES)
                await self._listen(pubsub, retry)
            except Exception as err:
                self._hearing = False
                await retry.wait(err)
            finally:
                self._hearing = False
                await pubsub.aclose()

    async def _listen(self, pubsub: aioredis.client.PubSub, retry: Retry) -> None:
        prefix, pinged = streams.placement_key(""), 0.0
        while True:
            now = time.monotonic()
            if now - pinged > HEARD_SECONDS / 4:
                await pubsub.ping()
                pinged = now
            if self._hearing and now - self._last_heard > HEARD_SECONDS:
                raise ConnectionError("the placement notices went silent")
            message = await pubsub.get_message(timeout=HEARD_SECONDS / 4)
            if message is None:
                continue
            self._last_heard = time.monotonic()
            self._notices += 1
            if message["type"] == "subscribe":  # from here on, every change is heard
                self._seen.clear()
                self._hearing = True
                retry.ok()
            elif message["type"] == "message":
                self._heard(message["data"], prefix)

    def _heard(self, notice: bytes, prefix: str) -> None:
        """A placement written (`<key> <value>`) or removed (`<key>`)."""
        key, _, value = notice.decode().partition(" ")
        try:
            placement = Placement.decode(value) if value else None
        except ValueError:
            log.error("unreadable placement notice %r: forgotten instead", notice)
            placement = None
        self._remember(key.removeprefix(prefix), placement)

    async def place(self, sid: str, replica: str) -> tuple[Placement, bool]:
        """(the session's placement, whether this call placed it). The placement (and
        its notice) and the replica's list are written at once, in one round trip's time
        (two slots, so not one transaction), and the list entry is taken back if the
        placement was not."""
        key, placement, since = streams.placement_key(sid), Placement(replica), self._notices
        placed, added = await asyncio.gather(  # at once (a script pipelines on no cluster)
            self._place(keys=[key], args=[placement.encode()]),
            self.client.sadd(streams.Keys(replica).placed, sid),
        )
        if placed:
            return self._saw(sid, placement, since), True
        found = await self.session(sid)
        if added and (found is None or found.replica != replica):
            await self.client.srem(streams.Keys(replica).placed, sid)
        if found is None:  # removed in between (a close): place it again
            return await self.place(sid, replica)
        return found, False

    async def forget(self, sid: str, replica: str) -> None:
        self._saw(sid, None, self._notices)
        key = streams.placement_key(sid)
        await self.client.delete(key)
        await self.client.publish(streams.PLACEMENT_CHANGES, key)  # heard as a removal
        await self.client.srem(streams.Keys(replica).placed, sid)

    async def take_back(self, sid: str, placement: Placement) -> None:
        """Remove `sid`'s placement and listing if it is still `placement` (an open that
        may or may not have placed it)."""
        if await self.swap_out(sid, placement):
            await self.client.srem(streams.Keys(placement.replica).placed, sid)

    async def swap(self, sid: str, old: Placement, new: Placement) -> bool:
        """Place `sid` as `new` if it is placed as `old`."""
        args, since = [old.encode(), new.encode()], self._notices
        swapped = bool(await self._swap(keys=[streams.placement_key(sid)], args=args))
        self._saw(sid, new if swapped else None, since)  # not swapped: read it again
        return swapped

    async def swap_out(self, sid: str, old: Placement) -> bool:
        """Remove `sid`'s placement if it is still `old` (a compare-and-delete)."""
        removed = bool(await self._unplace(keys=[streams.placement_key(sid)], args=[old.encode()]))
        self._saw(sid, None, self._notices)
        return removed

    async def begin(self, move: Move) -> bool:
        """Put the session in transit (listed first, so no transit goes unlisted), if it
        is still where the mover found it."""
        await self.client.zadd(streams.MOVES, {move.encode(): time.time() + self.lease_seconds})
        if await self.swap(move.sid, move.before, move.in_transit):
            return True
        await self.client.zrem(streams.MOVES, move.encode())
        return False

    async def commit(self, move: Move) -> bool:
        """The flip to the target. The target lists the session first: a close that
        lands the moment after the flip removes the placement and the target's listing
        (`forget`), and a listing added after it would name a session nobody holds. A
        listing whose flip failed is the target replica's own sweep's to remove
        (runtime/placed_sweep.py), as an open's that lost its race is."""
        await self.client.sadd(streams.Keys(move.target).placed, move.sid)
        if not await self.swap(move.sid, move.in_transit, move.after):
            return False
        await self.client.srem(streams.Keys(move.source).placed, move.sid)
        return True

    async def abort(self, move: Move) -> bool:
        return await self.swap(move.sid, move.in_transit, move.before)

    async def renew(self, move: Move) -> None:
        """This router holds `move` for another lease (if it is still listed)."""
        lease = {move.encode(): time.time() + self.lease_seconds}
        await self.client.zadd(streams.MOVES, lease, xx=True)

    async def done(self, move: Move) -> None:
        await self.client.zrem(streams.MOVES, move.encode())

    async def abandoned(self) -> list[Move]:
        """Moves whose router's lease ran out, each taken over by this router (of two
        routers asking at once, one gets each)."""
        now = time.time()
        taken = []
        for raw in await self.client.zrangebyscore(streams.MOVES, "-inf", now):
            try:
                move = Move.decode(raw)
            except ValueError:
                log.error("unreadable move %r in %s: dropped", raw, streams.MOVES)
                await self.client.zrem(streams.MOVES, raw)
                continue
            args = [raw, now, now + self.lease_seconds]
            if await self._take_over(keys=[streams.MOVES], args=args):
                taken.append(move)
        return taken

    async def placed_on(self, replica: str) -> list[str]:
        return sorted(m.decode() for m in await self.client.smembers(streams.Keys(replica).placed))

    async def remember_requests(self, tenant: str, rids: list[str], replica: str) -> None:
        """Where `rids` run, in one round trip (a pipeline: one key each)."""
        pipe = self.client.pipeline(transaction=False)
        for rid in rids:
            pipe.set(streams.request_key(f"{tenant}:{rid}"), replica, ex=REQUEST_TTL_SECONDS)
        await pipe.execute()

    async def request(self, tenant: str, rid: str) -> str | None:
        raw = await self.client.get(streams.request_key(f"{tenant}:{rid}"))
        return None if raw is None else raw.decode()
