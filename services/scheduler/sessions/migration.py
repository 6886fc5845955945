"""A session moving between replicas, one side at a time (the router drives it; the
placement directory is the commit point, docs/scaleout.md).

On the replica it leaves, the session stops taking turns (`moving`), its state is placed
on the disk tier, and it stays there, owned by the session as before, until the router
has placed it elsewhere and says so: then it is closed here, and its blob deleted. On
the replica it comes to, it is opened from the record the other replica persisted (its
history, conversation and owner), and its blob, when the record names one, is copied
into a disk slot of this replica by an `adopt` move of the next step; a copy that fails
leaves it to re-prefill its history, as after any lost state."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from services.scheduler.records.session import Session, SessionError
from shared.messages.ownership import SessionRecord

if TYPE_CHECKING:
    from services.scheduler.sessions.manager import SessionManager


def leave(sessions: SessionManager, sid: str) -> Session:
    """Stop `sid` taking turns here; its state is to be placed on the disk tier next."""
    session = sessions.sessions.get(sid)
    if session is None or session.closing:
        sessions.get(sid)  # raises the right error
    if session.turn is not None:
        raise SessionError(f"session {sid} has a turn in flight", "busy")
    session.moving = True
    return session


def left(sessions: SessionManager, sid: str) -> None:
    """The session lives on another replica (the caller checked the directory): close
    it here, freeing what it held."""
    sessions.depart(sid)


def stay(sessions: SessionManager, sid: str) -> None:
    """A move that failed before the placement changed: the session takes turns here
    again (its state is on disk now, and loads back for its next turn)."""
    session = sessions.sessions.get(sid)
    if session is None or not session.moving:
        raise SessionError(f"session {sid} is not moving away from this replica", "not_found")
    session.moving = False


def arrive(sessions: SessionManager, record: SessionRecord, source: str, epoch: int) -> Session:
    """Open the session of `record` (persisted by replica `source`) here at placement
    `epoch`, and plan the copy of its blob if it names one and a disk slot is free. A copy
    here of an older epoch was left by a move that never closed it: it is stale, and goes."""
    if record.closed:
        raise SessionError(f"session {record.sid} is closed", "not_found")
    here = sessions.sessions.get(record.sid)
    if here is not None and here.epoch >= epoch:  # a retried move: it arrived already
        return here
    if here is not None:
        sessions.depart(record.sid)
    sessions.forget_closed(record.sid)  # the directory placed it here anew: it may come
    session = sessions.open(record.sid, record.timeout, record.tenant)
    session.epoch, session.routed = epoch, True
    session.history = record.tokens().astype(np.int64)
    session.chat = None if record.chat is None else tuple(record.chat)
    if record.disk is not None and sessions.pools.disk.free_count:
        sessions.moves.adopt(session, source, record.disk, record.cached_len)
    return session
