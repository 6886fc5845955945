"""How a restarted scheduler takes its sessions back from the session store's records,
only once they are proven current (shared/records_proof.py: the store has applied every
record up to the stream's end as this life first saw it): the history always, the slots
too when the executor alive now is the one the records' slots belong to. Until the proof
comes, the sessions answer 503 with Retry-After; taken back late, they keep their history
only (their next turn re-prefills). A record the store holds that does not decode
is skipped with a warning: one bad record must not keep the scheduler from starting.

With replicas, the placement directory is the authority on where a session lives: a
record of a session placed on another replica (it moved while this one was down) is not
taken back but recorded closed here, and a blob it named is deleted as unnamed. A
session in transit from here is taken back moving (no turn starts) and at its placement's
epoch: the router that finishes or undoes the move decides where it lives.

A session the store lost (a gap its last life could not fill: services/session_store/
consumer.py) has no record any more; it answers `session_lost` (410) until its client
closes it, never 503 for ever."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import redis.asyncio as aioredis

from services.scheduler.sessions.manager import SessionManager
from services.scheduler.sessions.records import without_device_state
from shared import records_proof, streams
from shared.messages.envelope import WireError
from shared.messages.ownership import RECORDS, SessionRecord
from shared.placement import FIRST_EPOCH, Placement

log = logging.getLogger("custody.scheduler")


PROOF_WAIT_SECONDS = 2.0  # at start; then the sessions answer 503 until the proof comes


async def rebuild_sessions(
    client: aioredis.Redis, sessions: SessionManager, keys: streams.Keys
) -> tuple[str | None, str | None]:
    """Take back every recorded session whose records are proven current (shared/
    records_proof.py): (the live executor's epoch when there were records, their slots
    valid on it, else None; the stream entry the proof still waits for, else None). While
    the proof waits, every recorded session is `pending`: it answers 503, never a turn
    from a record older than the last one written; `finish_rebuild` takes them back."""
    await rehoming_over(client, keys)
    target = await records_proof.stream_end(client, keys)  # before this life writes
    proven = await records_proof.wait_records_current(client, keys, target, PROOF_WAIT_SECONDS)
    sids, placements = await _ours(client, sessions, keys)
    if not proven:
        log.warning(
            "the session store has not applied this replica's records up to %s: "
            "%d sessions answer 503 until it has",
            target,
            len(sids),
        )
        sessions.pending |= set(sids)
        return None, target
    await _lost(client, sessions, keys)
    records = await _records(client, keys, sids)
    alive = await client.get(keys.executor_alive)
    epoch = alive.decode() if alive else None
    valid = [
        r if epoch is not None and r.executor == epoch else without_device_state(r) for r in records
    ]
    sessions.rebuild(_still_ours(valid, placements, sessions), state_valid=True)
    sessions.discard_unnamed_blobs()
    _place(sessions, placements)
    if not records:
        return None, None
    log.info("rebuilt %d sessions from the session store", len(records))
    return epoch, None


async def finish_rebuild(
    client: aioredis.Redis, sessions: SessionManager, keys: streams.Keys, target: str
) -> None:
    """Once the store's records are proven current up to `target`, take back the pending
    sessions, from their history only: this life may have given their slots and blobs to
    other sessions meanwhile (their next turn re-prefills)."""
    while not await records_proof.records_current(client, keys, target):
        await asyncio.sleep(0.2)
    pending = sorted(sessions.pending)
    await _lost(client, sessions, keys)
    sids, placements = await _ours(client, sessions, keys)
    records = [
        msgspec.structs.replace(r, disk=None)
        for r in await _records(client, keys, [s for s in pending if s in sids])
    ]
    sessions.rebuild(_still_ours(records, placements, sessions), state_valid=False)
    sessions.dirty |= sessions.pending  # placed elsewhere now, or never recorded: closed
    sessions.pending.clear()
    _place(sessions, placements)
    log.info("rebuilt %d sessions from the session store, after waiting for it", len(records))


async def _ours(
    client: aioredis.Redis, sessions: SessionManager, keys: streams.Keys
) -> tuple[list[str], dict[str, Placement]]:
    """The recorded sessions this replica owns, and their placements. One the directory
    places elsewhere (it moved while this one was down) is recorded closed here."""
    sids: list[str] = []
    placements: dict[str, Placement] = {}
    for sid in sorted(k.decode() for k in await client.smembers(keys.sessions)):
        placed = await _placement(client, sid)
        if placed is not None and placed.replica != keys.replica:
            log.info("session %s lives on replica %s now; not taken back", sid, placed.replica)
            sessions.dirty.add(sid)  # recorded closed here
            continue
        if placed is not None:
            placements[sid] = placed
        sids.append(sid)
    return sids, placements


async def _lost(client: aioredis.Redis, sessions: SessionManager, keys: streams.Keys) -> None:
    """The sessions the store lost (`Keys.lost`, services/session_store/consumer.py): each
    answers `session_lost` until its client closes it, unless the directory places it on
    another replica now (then it is not this replica's to answer for)."""
    for sid in sorted(m.decode() for m in await client.smembers(keys.lost)):
        placed = await _placement(client, sid)
        if placed is None or placed.replica == keys.replica:
            sessions.lost.add(sid, FIRST_EPOCH if placed is None else placed.epoch)
        else:
            await client.srem(keys.lost, sid)


async def _records(client: aioredis.Redis, keys: streams.Keys, sids: list[str]) -> list:
    """The stored records of `sids`; one that does not decode is skipped with a warning."""
    records: list[SessionRecord] = []
    for sid in sids:
        raw = await client.hget(keys.session(sid), "record")
        if raw is None:
            continue
        try:
            records.append(RECORDS.decode(raw))
        except WireError as err:
            log.warning("session %s not rebuilt: its stored record is refused (%s)", sid, err)
    return records


def _still_ours(
    records: list[SessionRecord], placements: dict[str, Placement], sessions: SessionManager
) -> list[SessionRecord]:
    """The records of sessions still open: one a router placed (it carries an epoch)
    that the directory now places nowhere was closed elsewhere after it moved while
    this replica was down; taken back, it would be a second live copy of a closed
    session. It is recorded closed here instead."""
    kept = []
    for rec in records:
        if rec.epoch is not None and rec.sid not in placements:
            log.info("session %s was closed elsewhere; not taken back", rec.sid)
            sessions.dirty.add(rec.sid)
            continue
        kept.append(rec)
    return kept


def _place(sessions: SessionManager, placements: dict[str, Placement]) -> None:
    """A session taken back is at its placement's epoch, and moving if in transit."""
    for sid, placed in placements.items():
        if sid in sessions.sessions:
            session = sessions.sessions[sid]
            session.epoch, session.moving = placed.epoch, placed.moving_to is not None
            session.routed = True


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
