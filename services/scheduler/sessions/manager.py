"""Streaming sessions: open, close, one turn at a time, and the moves of their state.

A turn starts by taking the session's row, KV and Mamba state (session -> request, a
transfer, not shared references) and ends by giving them back (request -> session).
Before it changes anything, a turn gets a copy of the session's Mamba state (a deferred
copy into a session-owned slot); if the turn is aborted or retracted, that copy becomes
the session's state again and the KV past the session's history is freed, so the next
turn still prefills only its new tokens.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from protocol.copies import same_attempt
from services.scheduler.allocators import handover
from services.scheduler.allocators.pools import Pools
from services.scheduler.allocators.request_slots import RequestSlots
from services.scheduler.cache.radix_cache import RadixCache
from services.scheduler.ownership.invariants import Claim
from services.scheduler.ownership.lease import new_lease
from services.scheduler.ownership.owners import OwnerKind
from services.scheduler.records.request import ChatTurn, Request
from services.scheduler.records.sampling import InvalidRequest, SamplingParams
from services.scheduler.records.session import (
    ARRIVED,
    TURN_NAME,
    Session,
    SessionError,
    TurnStart,
    check_session_params,
)
from services.scheduler.records.turn_tree import TurnTree
from services.scheduler.sessions.chat_log import settle, turn_history
from services.scheduler.sessions.expiry import Deadlines
from services.scheduler.sessions.lost import LostSessions
from services.scheduler.sessions.records import DurableRecords, take_conversation, trusted_records
from services.scheduler.sessions.tier_moves import TierMoves
from services.scheduler.sessions.tier_policy import TierPolicy
from services.scheduler.sessions.turn_return import back_to_start, keep_finished, keep_reencoded
from shared.deferred_ops import DeferredOps
from shared.messages.ownership import SessionRecord
from shared.session_ids import session_name, valid_session_id

log = logging.getLogger("custody.sessions")
REMEMBER_CLOSED = 65536  # closed ids remembered, so a late turn hears "closed"


IDLE_SECONDS = 60.0  # a session unused this long counts as idle in a refusal's message


class SessionManager:
    def __init__(
        self,
        pools: Pools,
        cache: RadixCache,
        clock: Callable[[], float] = time.monotonic,
        limit: int | None = None,
        idle_timeout: float | None = None,
    ) -> None:
        self.pools = pools
        self.cache = cache
        self.clock = clock
        self.limit = limit  # sessions open at once; None: no limit
        # the timeout of a session whose client gave none (None: it never times out): no
        # client may be trusted to close what it opened (agents crash, closes get lost)
        self.idle_timeout = idle_timeout
        self.expired = 0  # sessions closed by their idle timeout
        self.opened = 0  # opens so far: a router counts its opens by this number
        self.sessions: dict[str, Session] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()
        self.dirty: set[str] = set()  # sessions whose durable record changed
        # a restarted scheduler whose session records are not proven current yet
        # (runtime/session_rebuild.py): every session it has not seen answers 503, since
        # the store may hold an older record of it, or not even have applied its opening
        self.awaiting_records = False
        self.lost = LostSessions()  # the store's decision on a gap (lost.py)
        self.conflicting_records = 0
        # whether this replica may serve its sessions now: its registration is provably
        # current (protocol/lives.py); the composition root sets it
        self.may_serve: Callable[[], bool] = lambda: True
        # routed sessions closed here (by their client, by their idle timeout) whose
        # placement this replica takes away (runtime/registration.py), should the router
        # that closed it die before it does, or no router know of the close at all
        self.unplaced: list[tuple[str, int]] = []
        self.states_dropped = 0
        self.reencoded = 0  # chat replies the session could not keep (chat_log.py)
        self.reply_starts = 0  # of them, resumed at the reply's start (turn_return.py)
        self.branch_turns = 0  # turns that gave the session's state up for a branch
        self.forks = 0
        self.deadlines = Deadlines()
        self.moves = TierMoves(pools, cache, self.dirty)
        self.tiers = TierPolicy(self.moves, self.sessions, lambda: self.clock())
        self.records = DurableRecords(pools, cache, self.sessions, self.dirty)

    # ---- client-facing ----
    def open(
        self,
        sid: str | None = None,
        timeout: float | None = None,
        tenant: str | None = None,
        limited: bool = True,
        streaming: bool = False,
    ) -> Session:
        """A new session of `tenant` (a key's hash), append-only if `streaming`. Refused
        ("limit") when `limit` are open, unless not `limited`: a rebuild takes back
        sessions that already exist."""
        if limited and self.limit is not None and len(self.sessions) >= self.limit:
            idle = self.idle_sessions(IDLE_SECONDS)
            oldest = f", the longest for {idle[0][1]:.0f} s" if idle else ""
            raise SessionError(
                f"{len(self.sessions)} sessions are open, as many as this server holds, "
                f"{len(idle)} of them idle for over {IDLE_SECONDS:.0f} s{oldest} (each closes "
                "after its idle timeout); close one or retry later",
                "limit",
            )
        timeout = self.idle_timeout if timeout is None else timeout
        if sid is None:
            sid = secrets.token_hex(16)  # no earlier life's: never in doubt
        elif not valid_session_id(sid):
            raise SessionError(f"{sid!r} is not a session id", "invalid")
        else:
            self._not_pending(sid)
        if sid in self.sessions or sid in self._closed:
            raise SessionError(f"session {session_name(sid)} already exists", "invalid")
        if timeout is not None and not 0 < timeout <= 7 * 24 * 3600:
            raise SessionError(f"timeout must lie in (0, 604800] seconds, got {timeout}", "invalid")
        owner = self.pools.ledger.new_owner(OwnerKind.SESSION, sid)
        session = Session(sid, owner, timeout, self.clock(), tenant=tenant, streaming=streaming)
        self.sessions[sid] = session
        self.opened += 1
        self.dirty.add(sid)
        self._touch(session, session.last_used)
        return session

    def get(self, sid: str) -> Session:
        """`sid`, to be served: refused while this replica cannot prove its right to its
        sessions (`may_serve`) or has not taken it back yet (`pending`)."""
        if not valid_session_id(sid):
            raise SessionError(f"{sid!r} is not a session id", "invalid")
        self._not_pending(sid)
        self._serving(sid)
        session = self.sessions.get(sid)
        if session is None:
            raise self._gone(sid)
        if session.closing or session.closed:
            raise SessionError(f"session {session_name(sid)} is closed", "closed")
        return session

    def _still_open(self, session: Session) -> None:
        """`session`, resolved by `get` before an await (at the HTTP edge), is refused as
        `get` would refuse its id now, without a second lookup."""
        self._not_pending(session.sid)
        self._serving(session.sid)
        if session.closed:
            raise self._gone(session.sid)
        if session.closing:
            raise SessionError(f"session {session.name} is closed", "closed")

    def _gone(self, sid: str) -> SessionError:
        """The refusal of `sid` no longer open here: lost, closed here, or never (or no
        longer: it departed) known."""
        if sid in self.lost:
            return self.lost.refusal(sid)
        if sid in self._closed:
            return SessionError(f"session {session_name(sid)} is closed", "closed")
        return SessionError(f"session {session_name(sid)} not found", "not_found")

    def begin_turn(
        self,
        session: Session,
        new_tokens: np.ndarray,
        params: SamplingParams,
        rid: str,
        context_len: int,
        session_params: dict | None = None,
        chat: ChatTurn | None = None,
        cache_namespace: str = "",
    ) -> Request:
        """A turn of `session` (resolved by `get`): a chat turn extends the history with
        `new_tokens`; a /generate turn follows its `session_params` through the session's
        turn tree (records/turn_tree.py). Checked before anything moves. A turn that does
        not continue the session's own state drops it and resumes from the deepest state
        the prefix cache kept on its path (its kept boundaries: `save`)."""
        self._still_open(session)
        sid = session.sid
        if session.turn is not None:
            raise SessionError(f"session {session_name(sid)} already has a turn in flight", "busy")
        if session.moving:
            raise SessionError(
                f"session {session_name(sid)} is moving to another replica; retry", "moving"
            )
        options = session_params or {}
        branch = None
        if chat is not None:
            if chat.seen != len(session.history) or not session.cached_len <= chat.base:
                raise SessionError(
                    f"session {session_name(sid)} changed while this turn was prepared", "busy"
                )
            kept = session.history[: chat.base]
        elif session.streaming:  # append-only: no tree to keep
            check_session_params(options, session)
            kept = session.history
        else:
            branch = session.turns.resolve(options, session.history, session.last_rid)
            kept = branch.base
        prompt = np.concatenate([kept, np.asarray(new_tokens, dtype=np.int64)])
        if len(prompt) >= context_len:
            raise InvalidRequest(
                f"session {session_name(sid)}: history ({len(kept)}) plus input "
                f"({len(new_tokens)}) tokens reach the context length {context_len}"
            )
        if not len(prompt):
            raise InvalidRequest(
                f"session {session_name(sid)}: the turn has no tokens (no input, and "
                "session_params keep no history)"
            )
        if branch is not None and not branch.continues(session.history, session.cached_len):
            self._drop_state(session)  # a branch: the cache holds what it resumes from
            self.branch_turns += 1
        name = options.get(TURN_NAME, "")
        req = Request(
            rid,
            prompt,
            params,
            session,
            name=name,
            chat=chat,
            branch=branch,
            cache_namespace=cache_namespace,
        )
        if chat is not None and session.cached_len < chat.reply_start <= len(prompt):
            req.reply_start = chat.reply_start
        session.turn = req
        self._touch(session, self.clock())
        return req

    def fork(self, parent: Session, options: dict, open_child: Callable[[], Session]) -> Session:
        """A new session (`open_child` opens it) whose history is `parent`'s as a turn
        with `options` (`rid`, `offset`, `drop_previous_output`) would continue it; checked
        before the child opens. It holds no state: its first turn resumes from the
        deepest state the prefix cache kept on that history (the parent's kept
        boundaries), which both then borrow, one copy of each page."""
        self._still_open(parent)
        base = parent.turns.resolve(options, parent.history, parent.last_rid).base
        child = open_child()
        self.forks += 1
        child.history = base.copy()
        if parent.chat is not None and len(base) == len(parent.history):
            child.chat = parent.chat  # forked at its latest turn: the conversation goes too
        self.dirty.add(child.sid)
        return child

    def close(self, sid: str) -> None:
        """Close now, or when the turn in flight ends; later turns are refused. Refused
        while the session moves: the replica it goes to would keep it open."""
        session = self.get(sid)
        if session.moving:
            raise SessionError(
                f"session {session_name(sid)} is moving to another replica; retry", "moving"
            )
        session.closing = True
        self.dirty.add(sid)  # recorded closed now: a restart must not resurrect it
        if session.turn is None:
            self._close_now(session)

    def depart(self, sid: str) -> None:
        """`sid` lives on another replica now: close it here without remembering it
        closed, for it may come back. A turn in flight must have ended first. Not gated
        by `may_serve`: a fenced replica releases what moved before it serves again."""
        session = self.sessions.get(sid)
        if session is None or session.closing:
            raise SessionError(f"session {session_name(sid)} not found", "not_found")
        if session.turn is not None:
            raise SessionError(f"session {session_name(sid)} has a turn in flight", "busy")
        session.closing = True
        self._close_now(session, departing=True)
        self.forget_closed(sid)

    def idle_sessions(self, at_least: float = 0.0) -> list[tuple[Session, float]]:
        """(session, seconds since its last use) of the sessions with no turn running,
        unused for `at_least` seconds, the longest idle first: what an operator looks at
        before the limit refuses opens (O(n log n): an operator route, a refusal)."""
        now = self.clock()
        idle = [
            (s, now - s.last_used)
            for s in self.sessions.values()
            if s.turn is None and now - s.last_used >= at_least
        ]
        return sorted(idle, key=lambda pair: -pair[1])

    def forget_lost(self, sid: str) -> bool:
        """Whether `sid` was lost: then its client's close ends it (lost.py)."""
        epoch = self.lost.pop(sid)
        if epoch is not None:
            self.unplaced.append((sid, epoch))
        return epoch is not None

    def forget_closed(self, sid: str) -> None:
        """`sid` closed here is no longer remembered as closed (a later session of that
        id is arriving: one closed here must not block it)."""
        self._closed.pop(sid, None)

    def expire(self) -> list[str]:
        """Close idle sessions past their timeout (expiry.py); returns their ids."""
        gone = []
        for sid, _ in self.deadlines.due(self.clock()):
            session = self.sessions.get(sid)
            if session is None or session.turn is not None or session.closing:
                continue  # its turn's end (or its close) sets or drops its deadline
            if session.moving:  # in use by its move, which decides where it ends
                self._touch(session, self.clock())
                continue
            session.closing = True
            self._close_now(session)
            self.expired += 1
            gone.append(sid)
        return gone

    def evict_idle(self, keep: Session | None = None) -> bool:
        """Device pressure: the least recently used session whose state no turn uses,
        other than `keep`, leaves the device: hibernated to the host tier
        (tier_policy.py), or, if the tiers below cannot take it, its state is dropped (its
        next turn re-prefills its history). False if no session holds device state it
        could give up."""
        victim = self.tiers.idle_on_device(keep)
        if victim is None:
            return False
        if self.tiers.host_room(victim.cached_len, keep=victim):
            self.moves.hibernate(victim)
            return True
        log.info("memory pressure: session %s drops its state (%d)", victim.sid, victim.cached_len)
        self._drop_state(victim)
        self.states_dropped += 1
        return True

    def drop_state_in(self, unwritten: set[int]) -> None:
        """A refused step left these Mamba slots unwritten: a session whose state would be
        one of them gives it up (its next turn re-prefills its history)."""
        for session in self.sessions.values():
            if session.slots is not None and session.slots.working.slot in unwritten:
                log.warning("session %s: its state slot was never written; re-prefill", session.sid)
                self._drop_state(session)
                self.states_dropped += 1

    def drop_volatile_state(self) -> None:
        """The executor was lost, and with it the device and host tiers' contents: only
        state on disk survives (a valid blob: its spill ran to the end)."""
        for session in self.sessions.values():
            if session.turn is None or session.turn.slots is None:
                self._drop_state(session, keep_disk=True)

    # ---- state moves, called by the engine ----
    def restore(self, req: Request, ops: DeferredOps) -> RequestSlots | None:
        """Give the session's state to its turn, with a rollback copy; None if the session
        has no state (the turn is then admitted like a plain request)."""
        session = req.session
        if session.slots is None:
            return None
        slots = handover.restore(self.pools, session.slots, req.rid)
        session.slots = None
        self.dirty.add(session.sid)  # lent: a restarted scheduler must not reuse this state
        row = slots.row.slot
        self.pools.kv.free_tail(row, session.cached_len, "trim")  # lesson 5, docs/ownership.md
        rollback = new_lease(
            self.pools.mamba, session.owner, self.pools.mamba.alloc_one(session.owner, "rollback")
        )
        ops.copy(slots.state.current.slot, rollback.slot, session.owner.id)
        req.turn_start = TurnStart(session.cached_len, rollback)
        req.cache_node, session.cache_node = session.cache_node, None
        req.computed = req.cached_tokens = session.cached_len
        return slots

    def save(self, req: Request, keep_boundary: Callable[[Request], None]) -> bool:
        """The turn finished: its state and history become the session's, and a turn of a
        session that may branch first gives `keep_boundary` its latest snapshot (the
        prefix cache's, docs/ownership.md "Kept boundaries"). A chat reply the session
        cannot keep as generated is re-encoded (chat_log.py): the session keeps the state
        at the reply's start (the page boundary before it going to `keep_boundary`), else
        at the turn's start. False when it keeps no state: the caller releases the turn's
        slots."""
        session, settled = req.session, settle(req)
        boundary = None if session.streaming else keep_boundary  # a streaming one never branches
        if settled is not None:
            canonical, at_reply_start = settled
            session.cached_len, kept_reply_start = keep_reencoded(
                self.pools, self.cache, req, at_reply_start, boundary
            )
            self.reencoded += 1
            self.reply_starts += kept_reply_start
            session.history = canonical
            self.dirty.add(session.sid)
            kept = session.slots is not None  # before a close the turn's end completes
            self._end_turn(req)
            return kept
        if boundary is not None:
            boundary(req)
        keep_finished(self.pools, req)
        session.history = turn_history(req)
        session.cached_len = req.computed
        if req.branch is not None:
            new_input = req.prompt[len(req.branch.base) :]
            session.turns.commit(req.branch, req.name or req.rid, new_input, req.committed_output())
        self.dirty.add(session.sid)
        self._end_turn(req)
        return True

    def rollback(self, req: Request, keep_turn: bool) -> None:
        """Abort or retract: back to the state at the turn's start. With `keep_turn` the
        turn stays the session's (a retract re-queues it)."""
        session, start = req.session, req.turn_start
        self.dirty.add(session.sid)
        if req.slots is not None:
            if start is None or start.rollback is None:
                req.release(self.pools, self.cache)  # the session had no state: it stays empty
            else:
                back_to_start(self.pools, req)
        req.slots, req.turn_start = None, None
        req.computed = 0
        if not keep_turn:
            self._end_turn(req)

    def claims(self) -> list[Claim]:
        out: list[Claim] = []
        for session in self.sessions.values():
            for state in (session.slots, session.host, session.disk):
                if state is not None:
                    out += state.claims(self.pools)
            turn = session.turn
            if turn is not None and turn.turn_start is not None and turn.turn_start.rollback:
                out.append((session.owner, "mamba", [turn.turn_start.rollback.held]))
        return out

    # ---- moves between replicas ----
    # The router drives a move, one side at a time; the placement directory is its commit
    # point (docs/scaleout.md). On the replica it leaves, the session stops taking turns
    # (`moving`), its state goes to the disk tier and stays there, owned by the session,
    # until the router has placed it elsewhere (`depart`). On the replica it comes to, it
    # is opened from the record the other replica persisted, and its blob copied into a
    # disk slot by an `adopt` move of the next step; a copy that fails leaves it to
    # re-prefill its history, as after any lost state.
    def leave(self, sid: str) -> Session:
        """Stop `sid` taking turns here; its state is to be placed on the disk tier next."""
        session = self.sessions.get(sid)
        if session is None or session.closing:
            self.get(sid)  # raises the right error
        if session.turn is not None:
            raise SessionError(f"session {session_name(sid)} has a turn in flight", "busy")
        session.moving = True
        session.leaves += 1
        return session

    def stay(self, sid: str) -> None:
        """A move that failed before the placement changed: the session takes turns here
        again (its state is on disk now, and loads back for its next turn)."""
        session = self.sessions.get(sid)
        if session is None or not session.moving:
            raise SessionError(
                f"session {session_name(sid)} is not moving away from this replica", "not_found"
            )
        session.moving = False

    def arrive(self, record: SessionRecord, source: str, epoch: int, move: str = "") -> Session:
        """Open the session of `record` (persisted by replica `source`) here at placement
        `epoch` by attempt `move` of its move, and plan the copy of its blob if it names
        one and a disk slot is free. A copy this very attempt brought stays; any other is
        stale, and goes (protocol/copies.py, `same_attempt`)."""
        if record.closed:
            raise SessionError(f"session {session_name(record.sid)} is closed", "not_found")
        here = self.sessions.get(record.sid)
        if same_attempt(here, move):
            return here
        if here is not None:
            self.depart(record.sid)
        self.forget_closed(record.sid)  # the directory placed it here anew: it may come
        session = self.open(record.sid, record.timeout, record.tenant)
        session.epoch, session.routed, session.arrival = epoch, True, move or ARRIVED
        take_conversation(session, record)
        if record.disk is not None and self.pools.disk.free_count:
            self.moves.adopt(session, source, record.disk, record.cached_len)
        return session

    # ---- after a restart ----
    def rebuild(self, records: list[SessionRecord], state_valid: bool) -> None:
        """A restarted scheduler takes its sessions back (records.py): the history always,
        a valid blob on disk, device slots when the executor that holds their contents is
        the same one and the records are trusted (`trusted_records`). Then every blob no
        session holds is deleted (an earlier life's deletion still pending when it ended,
        or a blob no record taken back names); the next step carries the deletions, before
        any move that writes a slot again."""
        records, cut = trusted_records(records, state_valid, self.pools)
        self.conflicting_records += cut
        for rec in records:
            if not rec.closed:
                session = self.open(rec.sid, rec.timeout, rec.tenant, limited=False)
                self.records.take_back(session, rec, state_valid)
        free = np.flatnonzero(self.pools.disk.owner_view[1:] == 0) + 1
        self.moves.discards += free.tolist()

    @property
    def tier_work(self) -> bool:
        """Blobs to delete, sessions to place or moves planned (an adopt): a step must be
        planned for them."""
        return bool(self.moves.discards or self.tiers.placing or self.moves.batch)

    # ---- internals ----
    def _serving(self, sid: str) -> None:
        """Serving a session needs this replica's right to its sessions: without it, the
        session may have been moved to another replica that serves it now."""
        if not self.may_serve():
            raise SessionError(
                f"session {session_name(sid)}: this replica cannot prove its registration "
                "current; retry",
                "fenced",
            )

    def in_doubt(self, sid: str) -> bool:
        """Whether `sid` may be a session of an earlier life that this one has not taken
        back yet: while the records are not proven current, any it has not seen."""
        return self.awaiting_records and not self.knows(sid)

    def knows(self, sid: str) -> bool:
        """Whether this life holds `sid` or closed it."""
        return sid in self.sessions or sid in self._closed

    def _not_pending(self, sid: str) -> None:
        if self.in_doubt(sid):
            raise SessionError(
                f"session {session_name(sid)} is being restored after a restart; retry",
                "rebuilding",
            )

    def _touch(self, session: Session, now: float) -> None:
        """`session` was used at `now`: its expiry deadline moves."""
        session.last_used = now
        if session.timeout is not None:
            self.deadlines.set(session.sid, now + session.timeout)

    def _end_turn(self, req: Request) -> None:
        session = req.session
        session.turn = None
        self._touch(session, self.clock())
        if session.closing:
            self._close_now(session)

    def reseed(self, sid: str) -> Session:
        """Session `sid` begins again, empty: its state and conversation go, its identity
        (owner, epoch, placement, timeout) stays. For a session bound by a header whose
        client sent another conversation (http/header_sessions.py): closing and opening
        it would take its placement away with the old one."""
        session = self.get(sid)
        if session.turn is not None:
            raise SessionError(f"session {session_name(sid)} has a turn in flight", "busy")
        if session.moving:
            raise SessionError(f"session {session_name(sid)} is moving; retry", "moving")
        self._drop_state(session)
        session.history = np.zeros(0, dtype=np.int64)
        session.chat, session.cached_len, session.last_rid = None, 0, ""
        session.turns = TurnTree()
        return session

    def _drop_state(self, session: Session, keep_disk: bool = False) -> None:
        self.dirty.add(session.sid)
        if session.slots is not None:
            handover.close(self.pools, session.slots, retire=False)
            session.slots = None
        if session.cache_node is not None:
            self.cache.unlock(session.cache_node)
            session.cache_node = None
        if session.host is not None:
            self.moves.drop_host(session, "drop")
        if session.disk is not None and not (keep_disk and session.disk.ready):
            self.moves.drop_disk(session, "drop")
        if session.disk is None:
            session.cached_len = 0

    def _close_now(self, session: Session, departing: bool = False) -> None:
        """Closed here; unless `departing` (it lives on elsewhere), its placement goes."""
        if session.routed and not departing:
            self.unplaced.append((session.sid, session.epoch))
        self._drop_state(session)
        session.closed = True
        self.dirty.add(session.sid)
        self.deadlines.drop(session.sid)
        del self.sessions[session.sid]
        self._closed[session.sid] = None
        if len(self._closed) > REMEMBER_CLOSED:
            self._closed.popitem(last=False)
        self.pools.ledger.retire(session.owner)
