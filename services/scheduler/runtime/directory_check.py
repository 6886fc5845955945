"""After its lease lapsed (protocol/lives.py), a replica checks every session it holds
against the placement directory before it serves any of them again: a router may have
found it dead and moved them meanwhile, and a client may have closed one on the replica it
moved to. Each session the directory no longer gives this replica, at this epoch, is
released here: its turn in flight (if any) is aborted, its clients told the session moved
(or, for a turn whose record was delayed past the lease, that its outcome is unknown:
Intake.refuse_turns), then the copy is closed. So one session never has two live copies,
and a copy here never counts against a key's limits twice.

A session the directory has in transit from here, though its copy was never told it is
leaving (the move found this replica unregistered and carries its records), keeps the
replica fenced until that move has ended: served meanwhile, its turn would be missing
from the copy the move brings.

A session without a placement is released only if it was placed by a router
(`Session.routed`): a session opened straight on this scheduler has none, and is kept.

The same check settles, every heartbeat, each copy a move left in doubt here
(`Session.in_doubt`): the router tells the replicas of a move how it ended, but that
request can be lost, and then the directory alone knows. A copy it gives elsewhere goes
(the source's after a commit, the target's after an abort); a leaving session it gives
back to this replica at the same epoch, with no target, takes turns again (an abort); an
arrived one it places here is no longer in doubt. So no copy stays `moving` for good,
holding its state and counting against its key's limits, and no stale arrival lingers."""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from protocol import copies
from services.scheduler.engine.core import EngineCore
from services.scheduler.runtime.intake import Intake
from shared import streams
from shared.placement import Placement

log = logging.getLogger("custody.scheduler")


async def release_moved(
    client: aioredis.Redis, engine: EngineCore, intake: Intake, replica: str
) -> bool:
    """Release every held session the directory gives elsewhere; returns whether the
    lease may be renewed: not while a move carries a held copy it never told (it found
    this replica unregistered: protocol/copies.py, `unaware_of_move`), which is checked
    again at the next heartbeat, once that move has ended."""
    unaware: list[str] = []
    sids = list(engine.sessions.sessions)
    released = await _check(client, engine, intake, replica, sids, unaware)
    if released:
        log.warning("released %d sessions placed elsewhere: %s", len(released), released)
    if unaware:
        log.warning("fenced while moves carry sessions held here: %s", unaware)
    return not unaware


async def settle(
    client: aioredis.Redis, engine: EngineCore, intake: Intake, replica: str
) -> list[str]:
    """Settle every copy a move left in doubt here, as the directory says; returns the
    ids released."""
    doubted = [  # a copy whose state a step still writes (an arrival's blob) waits a beat
        sid for sid, s in engine.sessions.sessions.items() if s.in_doubt and s.state_ready
    ]
    released = await _check(client, engine, intake, replica, doubted, [])
    if released:
        log.warning("released %d copies whose move ended elsewhere: %s", len(released), released)
    return released


async def _check(
    client: aioredis.Redis,
    engine: EngineCore,
    intake: Intake,
    replica: str,
    sids: list[str],
    unaware: list[str],
) -> list[str]:
    """Check `sids` against the directory: release each it gives elsewhere, settle each
    a move left in doubt that it gives to this replica, and add to `unaware` each a move
    carries off this replica without having told its copy."""
    released = []
    for sid in sids:
        session = engine.sessions.sessions.get(sid)
        if session is None:
            continue
        leaves = session.leaves
        try:
            placed = Placement.decode(await client.get(streams.placement_key(sid)))
        except ValueError as err:
            log.warning("session %s: its placement is unreadable (%s); kept here", sid, err)
            continue
        if session is not engine.sessions.sessions.get(sid) or session.leaves != leaves:
            continue  # closed, replaced or leaving again while the directory was read
        if placed is not None:
            session.routed = True
        if copies.released(session, placed, replica):
            intake.refuse_turns(session)
            if session.turn is not None:
                intake.ended(engine.abort(session.turn.rid, "the session moved to another replica"))
            engine.sessions.depart(sid)
            released.append(sid)
        elif copies.unaware_of_move(session, placed, replica):
            unaware.append(sid)
        elif copies.settled_here(session, placed, replica):  # here, no move under way
            session.arrival = ""
            if session.moving:
                log.warning("session %s: its move was undone; it takes turns here again", sid)
                engine.sessions.stay(sid)
    return released
