"""How a new scheduler life starts (the steps, in protocol/lives.py's order) and takes
its sessions back from the session store's records, only once they are proven current
(shared/records_proof.py: the store has applied every record up to the stream's end as
this life first saw it): the history always, the slots too when the executor alive now
is the one the records' slots belong to. Until the proof comes, the sessions answer 503
with Retry-After; taken back late, they keep their history only (their next turn
re-prefills). A record the store holds that does not decode is skipped with a warning:
one bad record must not keep the scheduler from starting.

With replicas, the placement directory is the authority on where a session lives
(protocol/lives.py's `take_back`): a record of a session placed on another replica (it
moved while this one was down) is not taken back but recorded closed here, and a blob it
named is deleted as unnamed. A session in transit from here is taken back moving (no
turn starts) and at its placement's epoch: the front that finishes or undoes the move
decides where it lives.

A session the store lost (a gap its last life could not fill: services/session_store/
consumer.py) has no record any more; it answers `session_lost` (410) until its client
closes it, never 503 for ever."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
import redis.asyncio as aioredis

from protocol import lives
from protocol.lives import Step, Taken
from services.scheduler.sessions.manager import SessionManager
from services.scheduler.sessions.records import without_device_state
from shared import records_proof, streams
from shared.messages.envelope import WireError
from shared.messages.ownership import RECORDS, SessionRecord
from shared.placement import FIRST_EPOCH, Placement

log = logging.getLogger("custody.scheduler")


PROOF_WAIT_SECONDS = 2.0  # at start; then the sessions answer 503 until the proof comes


async def start_life(
    client: aioredis.Redis,
    sessions: SessionManager,
    keys: streams.Keys,
    register: Callable[[], Awaitable[object]],
) -> tuple[str | None, str | None]:
    """This life's first steps, in the order protocol/lives.py decides (`START`), ending
    with every recorded session whose records are proven current taken back: (the live
    executor's epoch when there were records, their slots valid on it, else None; the
    stream entry the proof still waits for, else None). While the proof waits, every
    session this life has not seen is in doubt (`SessionManager.awaiting_records`): it
    answers 503, never a turn from a record older than the last one written, nor 404 for
    a session whose opening the store has not applied yet. `finish_rebuild` takes them
    back."""
    target, proven = records_proof.NO_STREAM, True
    for step in lives.START:
        match step:
            case Step.REGISTER:
                await register()
            case Step.AWAIT_REHOMING:
                await rehoming_over(client, keys)
            case Step.READ_STREAM_END:  # before this life writes
                target = await records_proof.stream_end(client, keys)
            case Step.AWAIT_PROOF:
                proven = await records_proof.wait_records_current(
                    client, keys, target, PROOF_WAIT_SECONDS
                )
            case Step.TAKE_BACK:
                return await _take_back(client, sessions, keys, target, proven)
    raise AssertionError("protocol/lives.py START ends with TAKE_BACK")


async def _take_back(
    client: aioredis.Redis,
    sessions: SessionManager,
    keys: streams.Keys,
    target: str,
    proven: bool,
) -> tuple[str | None, str | None]:
    if not proven:
        log.warning(
            "the session store has not applied this replica's records up to %s: "
            "%d recorded sessions, and any whose records are not applied yet, answer 503 "
            "until it has",
            target,
            await client.scard(keys.sessions),
        )
        sessions.awaiting_records = True
        return None, target
    placements = await _placements(client, sessions, keys)
    await _lost(client, sessions, keys)
    records = await _records(client, keys, list(placements))
    alive = await client.get(keys.executor_alive)
    epoch = alive.decode() if alive else None
    valid = [
        r if epoch is not None and r.executor == epoch else without_device_state(r) for r in records
    ]
    _rebuild(sessions, keys.replica, valid, placements, state_valid=True)
    if not records:
        return None, None
    log.info("rebuilt %d sessions from the session store", len(records))
    return epoch, None


async def finish_rebuild(
    client: aioredis.Redis, sessions: SessionManager, keys: streams.Keys, target: str
) -> None:
    """Once the store's records are proven current up to `target`, take back every
    recorded session this life has not seen, from its history only: this life may have
    given their slots and blobs to other sessions meanwhile (their next turn
    re-prefills)."""
    while not await records_proof.records_current(client, keys, target):
        await asyncio.sleep(0.2)
    await _lost(client, sessions, keys)
    placements = await _placements(client, sessions, keys)
    unseen = [sid for sid in placements if not sessions.knows(sid)]
    records = [msgspec.structs.replace(r, disk=None) for r in await _records(client, keys, unseen)]
    sessions.awaiting_records = False
    _rebuild(sessions, keys.replica, records, placements, state_valid=False)
    # placed elsewhere now, or with no record left: recorded closed here
    sessions.dirty |= {sid for sid in unseen if sid not in sessions.sessions}
    log.info("rebuilt %d sessions from the session store, after waiting for it", len(records))


async def _placements(
    client: aioredis.Redis, sessions: SessionManager, keys: streams.Keys
) -> dict[str, Placement | None]:
    """Every session recorded on this replica, and where the directory places it now."""
    sids = sorted(k.decode() for k in await client.smembers(keys.sessions))
    return {sid: await _placement(client, sid) for sid in sids}


def _rebuild(
    sessions: SessionManager,
    replica: str,
    records: list[SessionRecord],
    placements: dict[str, Placement | None],
    state_valid: bool,
) -> None:
    """Take back each record as protocol/lives.py's `take_back` decides: at its
    placement's epoch, moving if in transit from here, arriving if it is the arrival of
    the attempt in transit here; one the directory gives elsewhere, or places nowhere
    though a front placed it, is recorded closed here instead."""
    kept: list[SessionRecord] = []
    for rec in records:
        placed = placements.get(rec.sid)
        taken = lives.take_back(placed, replica, rec.epoch is not None, rec.arrival)
        if taken is Taken.CLOSED:
            log.info("session %s placed %s now: not taken back", rec.sid, placed)
            sessions.dirty.add(rec.sid)  # recorded closed here
            continue
        kept.append(rec)
    sessions.rebuild(kept, state_valid=state_valid)
    for rec in kept:
        placed = placements.get(rec.sid)
        if placed is not None and rec.sid in sessions.sessions:
            session = sessions.sessions[rec.sid]
            session.routed = True
            if placed.replica == replica:
                session.epoch, session.moving = placed.epoch, placed.moving_to is not None
            else:  # the arrival of the attempt in transit here: in doubt until it ends
                session.epoch, session.arrival = placed.epoch + 1, rec.arrival


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
