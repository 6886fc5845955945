"""The replica's own list of placed sessions (`Keys.placed`), kept true: the other half
of what directory_check.py does for the sessions it holds.

A member of the list stops being true in two ways, each left by a process killed between
two writes: its placement went (a close whose router died before it removed the member)
or moved elsewhere; or its placement names this replica, which does not hold the session
(an open or a move that never arrived, a session lost with a scheduler before its record
was written). Neither is ever looked at again by anything else: a drain or a re-homing
would try to move it for good, and the keys outlive everything (the fault campaign left
a few per half hour).

So, a batch a heartbeat, the replica walks its list (SSCAN) and checks each member it
does not hold against the directory. One found untrue is only suspected at first: an open
in flight places the session a moment before the replica opens it. A member still untrue,
with the same placement value, `GRACE_SECONDS` later goes: the member, and a placement
naming this replica, by compare-and-delete (never one written since). Never while the
session is in transit (its move decides), nor while the lease has lapsed (what this
replica holds is then in doubt)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from services.scheduler.sessions.manager import SessionManager
from shared import streams
from shared.placement import UNPLACE, Placement

log = logging.getLogger("custody.scheduler")

GRACE_SECONDS = 30.0  # longer than an open or a move takes between placement and arrival
BATCH = 64  # members looked at per heartbeat


class PlacedSweep:
    def __init__(
        self,
        keys: streams.Keys,
        sessions: SessionManager,
        clock: Callable[[], float] = time.monotonic,
        grace: float = GRACE_SECONDS,
    ) -> None:
        self.keys, self.sessions, self.clock, self.grace = keys, sessions, clock, grace
        self.cursor = 0
        self.suspects: dict[str, tuple[float, bytes | None]] = {}  # sid -> (since, value)
        self.walked: set[str] = set()  # members met since the walk began
        self.dropped = 0  # members (and placements) found untrue and removed

    async def step(self, client: aioredis.Redis) -> None:
        """Look at the next batch of the list."""
        self.cursor, members = await client.sscan(self.keys.placed, self.cursor, count=BATCH)
        batch = [m.decode() if isinstance(m, bytes) else m for m in members]
        self.walked.update(batch)
        if self.cursor == 0:  # a walk done: a suspect it did not meet left the list
            self.suspects = {s: v for s, v in self.suspects.items() if s in self.walked}
            self.walked = set()
        for sid in batch:
            sessions = self.sessions
            if sid in sessions.sessions or sessions.in_doubt(sid) or sid in sessions.lost:
                self.suspects.pop(sid, None)
                continue
            value = await client.get(streams.placement_key(sid))
            await self._judge(client, sid, value)

    async def _judge(self, client: aioredis.Redis, sid: str, value: bytes | None) -> None:
        try:
            placed = Placement.decode(value)
        except ValueError:
            return  # unreadable: not this sweep's to decide
        if placed is not None and placed.moving_to is not None:
            self.suspects.pop(sid, None)
            return
        since, seen = self.suspects.setdefault(sid, (self.clock(), value))
        if seen != value:
            self.suspects[sid] = (self.clock(), value)
            return
        if self.clock() - since < self.grace:
            return
        del self.suspects[sid]
        if placed is not None and placed.replica == self.keys.replica:
            script = client.register_script(UNPLACE)
            if not await script(keys=[streams.placement_key(sid)], args=[value]):
                return  # rewritten since: left for the next walk
        await client.srem(self.keys.placed, sid)
        self.dropped += 1
        log.warning(
            "session %s: listed as placed here but not held here (placement %s); removed",
            sid,
            None if placed is None else placed.encode(),
        )
