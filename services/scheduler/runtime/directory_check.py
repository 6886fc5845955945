"""After its lease lapsed (replica_lease.py), a replica checks every session it holds
against the placement directory before it serves any of them again: a router may have
found it dead and moved them meanwhile, and a client may have closed one on the replica it
moved to. Each session the directory no longer gives this replica, at this epoch, is
released here: its turn in flight (if any) is aborted, its clients told the session moved
(or, for a turn whose record was delayed past the lease, that its outcome is unknown:
Intake.refuse_turns), then the copy is closed. So one session never has two live copies,
and a copy here never counts against a key's limits twice.

A session without a placement is released only if it was placed by a router
(`Session.routed`): a session opened straight on this scheduler has none, and is kept."""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from services.scheduler.engine.core import EngineCore
from services.scheduler.records.session import Session
from services.scheduler.runtime.intake import Intake
from shared import streams
from shared.placement import Placement

log = logging.getLogger("custody.scheduler")


def gone(session: Session, placed: Placement | None, replica: str) -> bool:
    """Whether the directory no longer gives `session` to `replica` at its epoch."""
    if placed is None:
        return session.routed
    if not placed.names(replica):
        return True
    return placed.replica == replica and placed.epoch > session.epoch


async def release_moved(
    client: aioredis.Redis, engine: EngineCore, intake: Intake, replica: str
) -> list[str]:
    """Release every held session the directory gives elsewhere; returns their ids."""
    released = []
    for sid, session in list(engine.sessions.sessions.items()):
        try:
            placed = Placement.decode(await client.get(streams.placement_key(sid)))
        except ValueError as err:
            log.warning("session %s: its placement is unreadable (%s); kept here", sid, err)
            continue
        if session is not engine.sessions.sessions.get(sid):
            continue  # closed (or replaced) while the directory was read
        if placed is not None:
            session.routed = True
        if not gone(session, placed, replica):
            continue
        intake.refuse_turns(session)
        if session.turn is not None:
            intake.ended(engine.abort(session.turn.rid, "the session moved to another replica"))
        engine.sessions.depart(sid)
        released.append(sid)
    if released:
        log.warning("released %d sessions placed elsewhere: %s", len(released), released)
    return released
