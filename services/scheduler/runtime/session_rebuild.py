"""How a restarted scheduler takes its sessions back from the session store's records:
the history always, the slots too when the store has applied everything on the ownership
stream and the executor alive now is the one the records' slots belong to; otherwise
history only (their next turn re-prefills). A record the store holds that does not decode
is skipped with a warning: one bad record must not keep the scheduler from starting.

With replicas, the placement directory is the authority on where a session lives: a
record of a session placed on another replica (it moved while this one was down) is not
taken back but recorded closed here, and a blob it named is deleted as unnamed. A
session in transit from here is taken back moving (no turn starts) and at its placement's
epoch: the router that finishes or undoes the move decides where it lives."""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from services.scheduler.sessions.manager import SessionManager
from shared import streams
from shared.messages.envelope import WireError
from shared.messages.ownership import RECORDS, SessionRecord
from shared.placement import Placement

log = logging.getLogger("custody.scheduler")


async def rebuild_sessions(
    client: aioredis.Redis, sessions: SessionManager, keys: streams.Keys
) -> str | None:
    """Rebuild every recorded session; returns the live executor's epoch when there were
    records (their slots are valid on it), else None."""
    await rehoming_over(client, keys)
    caught_up = await store_caught_up(client, keys)
    sids = await client.smembers(keys.sessions)
    records: list[SessionRecord] = []
    placements: dict[str, Placement] = {}
    for sid in sorted(k.decode() for k in sids):
        placed = await _placement(client, sid)
        if placed is not None and placed.replica != keys.replica:
            log.info("session %s lives on replica %s now; not taken back", sid, placed.replica)
            sessions.dirty.add(sid)  # recorded closed here
            continue
        if placed is not None:
            placements[sid] = placed
        raw = await client.hget(keys.session(sid), "record")
        if raw is None:
            continue
        try:
            records.append(RECORDS.decode(raw))
        except WireError as err:
            log.warning("session %s not rebuilt: its stored record is refused (%s)", sid, err)
    alive = await client.get(keys.executor_alive)
    epoch = alive.decode() if alive else None
    for group in {r.executor for r in records}:
        valid = caught_up and epoch is not None and group == epoch
        sessions.rebuild([r for r in records if r.executor == group], valid)
    sessions.discard_unnamed_blobs()
    for sid, placed in placements.items():
        if sid in sessions.sessions:
            session = sessions.sessions[sid]
            session.epoch, session.moving = placed.epoch, placed.moving_to is not None
    if not records:
        return None
    log.info("rebuilt %d sessions from the session store", len(records))
    return epoch


async def _placement(client: aioredis.Redis, sid: str) -> Placement | None:
    """`sid`'s placement; one that does not read is taken as none (the session is taken
    back here), so one bad value cannot keep the scheduler from starting."""
    raw = await client.get(streams.placement_key(sid))
    try:
        return Placement.decode(raw)
    except ValueError as err:
        log.warning("session %s: its placement is unreadable (%s); taken back here", sid, err)
        return None


async def rehoming_over(client: aioredis.Redis, keys: streams.Keys, timeout: float = 300) -> None:
    """Until no router is re-homing this replica's sessions (it was found dead): what it
    moves, this scheduler must not take back."""
    deadline = time.monotonic() + timeout
    while await client.exists(keys.rehoming) and time.monotonic() < deadline:
        log.info("a router is re-homing this replica's sessions; waiting")
        await asyncio.sleep(0.5)


async def store_caught_up(
    client: aioredis.Redis, keys: streams.Keys, timeout: float = 10.0
) -> bool:
    """Whether the store has applied everything on the ownership stream."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            groups = await client.xinfo_groups(keys.ownership)
            info = await client.xinfo_stream(keys.ownership)
        except aioredis.ResponseError:
            return True  # no stream yet: nothing to catch up on
        store = next((g for g in groups if g["name"].decode() == streams.STORE_GROUP), None)
        last = info["last-generated-id"]
        if store is not None and store["pending"] == 0 and store["last-delivered-id"] == last:
            return True
        await asyncio.sleep(0.1)
    return False
