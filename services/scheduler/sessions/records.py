"""A session's durable record (`SessionRecord`, shared/messages/ownership.py): what
the session store persists for it, and how a restarted scheduler takes its sessions back
from those records.

A record carries the history always (and a chat session's conversation), the owner (a
hash of the API key, never the key) and, only while the session itself holds them (not
lent to a turn) and no step in flight still copies its state into them (`unwritten`: an
aborted turn's rollback copy), its row, working Mamba slot and KV pages: only then can a
restarted scheduler take them over. (A restart with such a step in flight once gave the
session a slot that step never wrote: its next turn ran on a state nothing had written.)
The first pages may be the prefix cache's, which the session borrows (`shared_pages`): a
restarted scheduler, whose cache starts empty, gives them back to a cache path of their
own, which every session that shared them borrows again (docs/ownership.md, "Shared
prefixes"). A session closed, or closing during a turn, is recorded closed at once.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import msgspec
import numpy as np

from services.scheduler.allocators import handover
from services.scheduler.allocators.paged_kv import pages_for
from services.scheduler.allocators.pools import Pools
from services.scheduler.allocators.tier_slots import DiskState
from services.scheduler.cache.radix_cache import RadixCache
from services.scheduler.ownership.lease import new_lease
from services.scheduler.records.response_tree import ResponseTree
from services.scheduler.records.session import Session
from services.scheduler.records.turn_tree import TurnTree
from shared.messages.envelope import I4, I8, array
from shared.messages.ownership import SessionRecord
from shared.owners import OwnerKind, kind_of

log = logging.getLogger("custody.scheduler")


class DurableRecords:
    """Writes the records of the sessions it is given and takes their state back from
    records after a restart; `SessionManager` holds it and opens the sessions."""

    def __init__(
        self, pools: Pools, cache: RadixCache, sessions: dict[str, Session], dirty: set[str]
    ) -> None:
        self.pools, self.cache = pools, cache
        self.sessions = sessions  # the manager's open sessions, by id
        self.dirty = dirty  # sessions whose record changed since the last `take_records`
        # Mamba slots the deferred copies of steps in flight write, with how many steps
        # (`in_flight.py` says when a step starts and stops writing them)
        self.unwritten: dict[int, int] = defaultdict(int)

    def copying(self, destinations: list[int]) -> None:
        """A step that copies into `destinations` is in flight."""
        for slot in destinations:
            self.unwritten[slot] += 1

    def copied(self, destinations: list[int]) -> None:
        """That step ran, or never will: a session holding one of its destinations is
        recorded again (with its slots if they are written, without if not: the caller
        drops an unwritten state first, faults.py). Most steps copy nothing: then it
        costs nothing, not a look at every session."""
        if not destinations:
            return
        for slot in destinations:
            self.unwritten[slot] -= 1
            if not self.unwritten[slot]:
                del self.unwritten[slot]
        done = set(destinations)
        for sid, s in self.sessions.items():
            if s.slots is not None and s.slots.working.held in done:
                self.dirty.add(sid)

    def take_records(self) -> list[SessionRecord]:
        """What changed since the last call, as records the session store persists."""
        out = [self._record(sid) for sid in sorted(self.dirty)]
        self.dirty.clear()
        return out

    def all_records(self) -> list[SessionRecord]:
        """Every open session's record: the full set the store is sent after a snapshot,
        which replaces whatever a gap in the stream made it lose."""
        return [self._record(sid) for sid in sorted(self.sessions)]

    def _record(self, sid: str) -> SessionRecord:
        """`sid`'s record: the history always; the slots only while the session itself
        holds them (not lent to a turn), since only then can a restarted scheduler take
        them over."""
        s = self.sessions.get(sid)
        if s is None or s.closing:
            return SessionRecord(sid=sid, closed=True)
        rec = SessionRecord(
            sid=sid,
            timeout=s.timeout,
            tenant=s.tenant,  # its owner survives a restart (a hash, never a key)
            history=array(s.history, I4),
            cached_len=s.cached_len,
            chat=None if s.chat is None else list(s.chat),  # docs/chat.md
            last_rid=s.last_rid,
            turns=s.turns.entries(),
            responses=s.responses.entries(),
            streaming=s.streaming,
            epoch=s.epoch if s.routed else None,
            arrival=s.arrival,
        )
        if s.disk is not None and s.disk.ready:
            rec.disk, rec.cached_len = s.disk.blob.slot, s.disk.tokens
        elif s.slots is not None and int(s.slots.working.held) not in self.unwritten:
            rec.row = s.slots.row.slot
            rec.working = s.slots.working.slot
            rec.pages = array(self.pools.rows.row_pages(rec.row, 0, s.cached_len), I8)
            if s.cache_node is not None:
                rec.shared_pages = s.slots.borrowed // self.pools.config.page_size
                rec.cache_namespace = s.cache_node.namespace
        return rec

    def take_back(self, session: Session, rec: SessionRecord, state_valid: bool) -> None:
        """`session`, opened anew from `rec`, takes back its history always, a valid blob
        on disk, and device slots when `state_valid` (the executor that holds their
        contents is the same one)."""
        take_conversation(session, rec)
        if rec.disk is not None:  # a valid blob outlives every executor
            self.pools.disk.take(np.array([rec.disk]), session.owner, "rebuild")
            lease = new_lease(self.pools.disk, session.owner, rec.disk)
            session.disk = DiskState(session.owner, lease, rec.cached_len, ready=True)
            session.cached_len = rec.cached_len
            return
        if not state_valid or rec.row is None or rec.working is None:
            return
        unusable = self._unusable(rec)
        if unusable is not None:
            log.error("session %s: its device state is not taken back (%s)", rec.sid, unusable)
            return
        owner, pools = session.owner, self.pools
        row, working = np.array([rec.row]), np.array([rec.working])
        pages = rec.kv_pages().astype(np.int64)
        shared = rec.shared_pages * pools.config.page_size
        if shared:  # first: a path another record made may already hold these pages
            prefix = session.history[:shared], pages[: rec.shared_pages]
            try:
                session.cache_node = self.cache.adopt(*prefix, rec.cache_namespace)
            except ValueError as err:  # the tree holds other pages for that prefix
                log.error("session %s: its device state is not taken back (%s)", rec.sid, err)
                return
        pools.req.take(row, owner, "rebuild")
        pools.mamba.take(working, owner, "rebuild")
        pools.kv_pages.take(pages[rec.shared_pages :], owner, "rebuild")
        pools.kv.restore_row(rec.row, pages, rec.cached_len)
        session.slots = handover.SessionSlots(
            owner,
            new_lease(pools.req, owner, rec.row),
            new_lease(pools.mamba, owner, rec.working),
            borrowed=shared,
        )
        session.cached_len = rec.cached_len

    def _unusable(self, rec: SessionRecord) -> str | None:
        """Why `rec`'s device slots (well-formed: `malformed`) cannot be taken over as the
        pools stand, or None: each must be free, a shared page free or the cache's (a path
        another record of the prefix adopted)."""
        pools = self.pools
        own, shared = rec.kv_pages()[rec.shared_pages :], rec.kv_pages()[: rec.shared_pages]
        for pool, slots in (
            (pools.req, [rec.row]),
            (pools.mamba, [rec.working]),
            (pools.kv_pages, own),
        ):
            if (pool.owner_view[np.asarray(slots, dtype=np.int64)] != 0).any():
                return f"{pool.name} slots held already"
        held = pools.kv_pages.owner_view[shared]
        if any(o != 0 and kind_of(int(o)) is not OwnerKind.CACHE for o in held):
            return "shared pages held by a session or a request"
        return None


def malformed(rec: SessionRecord, pools: Pools) -> str | None:
    """Why `rec`'s device slots do not add up, or None: slots inside their pools, pages
    that cover `cached_len` and each named once, a shared prefix within the history. A
    record the store kept wrongly must cost its session the state, never the scheduler
    its start."""
    if rec.closed or rec.row is None or rec.working is None:
        return None
    ps, pages = pools.config.page_size, rec.kv_pages().astype(np.int64)
    if not rec.shared_pages * ps <= rec.cached_len <= len(rec.tokens()):
        return f"{rec.cached_len} positions of a {len(rec.tokens())}-token history"
    if len(pages) != pages_for(rec.cached_len, ps):
        return f"{len(pages)} pages for {rec.cached_len} positions"
    if len(np.unique(pages)) != len(pages):
        return "a page named twice"
    for pool, slots in (
        (pools.req, [rec.row]),
        (pools.mamba, [rec.working]),
        (pools.kv_pages, pages),
    ):
        slots = np.asarray(slots, dtype=np.int64)
        if len(slots) and (slots.min() < 1 or slots.max() > pool.capacity):
            return f"{pool.name} slots outside the pool"
    return None


def conflicting_claims(records: list[SessionRecord], state_valid: bool, page_size: int) -> set[str]:
    """The sessions whose records claim a slot (a blob; with `state_valid`, a row, a
    Mamba slot or a KV page) that another record claims too. A shared page may be
    claimed by many records, if every one of them names it as the same page of the same
    prefix in the same namespace, and a shared prefix's page must be the same page in
    every record that shares it. The store applies records in order, so this is a
    fault of its own or a record it kept that it should not have; one such pair must
    not keep the scheduler from starting."""
    claims: defaultdict[tuple[str, object], defaultdict[object, set[str]]] = defaultdict(
        lambda: defaultdict(set)
    )
    for rec in records:
        if rec.closed:
            continue
        if rec.disk is not None:
            claims["disk", rec.disk][rec.sid].add(rec.sid)
            continue
        if not state_valid or rec.row is None or rec.working is None:
            continue
        claims["req", rec.row][rec.sid].add(rec.sid)
        claims["mamba", rec.working][rec.sid].add(rec.sid)
        tokens = rec.tokens()
        for i, page in enumerate(rec.kv_pages().tolist()):
            prefix = tokens[: (i + 1) * page_size].tobytes()
            shared = i < rec.shared_pages
            claims["kv", page][(rec.cache_namespace, prefix) if shared else rec.sid].add(rec.sid)
            if shared:
                claims["prefix", (rec.cache_namespace, prefix)][page].add(rec.sid)
    return {sid for by in claims.values() if len(by) > 1 for sids in by.values() for sid in sids}


def without_device_state(rec: SessionRecord, disk: bool = False) -> SessionRecord:
    """`rec` without its claims on device slots (and, with `disk`, on its blob)."""
    rec = msgspec.structs.replace(
        rec, row=None, working=None, pages=None, shared_pages=0, cache_namespace=""
    )
    return msgspec.structs.replace(rec, disk=None) if disk else rec


def trusted_records(
    records: list[SessionRecord], state_valid: bool, pools: Pools
) -> tuple[list[SessionRecord], int]:
    """The records a restarted scheduler takes back: each whose slots do not add up
    (`malformed`), or that claims a slot another record claims too (`conflicting_claims`),
    without its device state (which of them holds the slot's contents cannot be known,
    and the history is the session either way); and how many were so cut (logged)."""
    cut = 0
    if state_valid:
        kept = []
        for rec in records:
            wrong = malformed(rec, pools)
            if wrong is not None:
                log.error("session %s: taken back from its history only (%s)", rec.sid, wrong)
                rec, cut = without_device_state(rec), cut + 1
            kept.append(rec)
        records = kept
    doubtful = conflicting_claims(records, state_valid, pools.config.page_size)
    if doubtful:
        log.error(
            "%d session records claim slots another record claims too; "
            "they are taken back from their history only: %s",
            len(doubtful),
            sorted(doubtful),
        )
        records = [without_device_state(r, disk=True) if r.sid in doubtful else r for r in records]
    return records, cut + len(doubtful)


def take_conversation(session: Session, rec: SessionRecord) -> None:
    """What every copy of a session carries from its record, whatever became of its
    state (a restart, a move): its history, its conversation, the latest turn a client
    may name (`session_params.rid`) and the turns it may branch from. A tree that does
    not hold together costs the session its branches, never its history."""
    session.history = rec.tokens().astype(np.int64)
    session.chat = None if rec.chat is None else tuple(rec.chat)
    session.last_rid = rec.last_rid
    session.streaming = rec.streaming
    try:
        session.turns = TurnTree.of(rec.turns, rec.last_rid)
    except ValueError as err:
        log.error("session %s: its turn tree is not taken back (%s)", rec.sid, err)
    try:
        session.responses = ResponseTree.of(rec.responses)
    except ValueError as err:
        log.error("session %s: its stored responses are not taken back (%s)", rec.sid, err)
