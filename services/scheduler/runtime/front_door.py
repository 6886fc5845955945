"""What the HTTP edge may ask of the scheduler, and nothing more: submit a request or a
session turn and wait for it, open and close sessions, abort, flush the cache, and read
what the edge shows (health, model info, metrics). Handlers never reach past this into
the engine, its sessions, cache or queues; every call that changes state wakes the step
loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import numpy as np
import redis.asyncio as aioredis

from protocol.copies import close_stands, may_close, settled_here, takes_arrival
from services.scheduler.engine.core import EngineCore
from services.scheduler.records.request import Request
from services.scheduler.records.session import Session, SessionError
from services.scheduler.records.turn import Turn
from services.scheduler.runtime.executor_link import ExecutorLink
from services.scheduler.runtime.grammar_checks import GrammarChecks
from services.scheduler.runtime.intake import Intake
from services.scheduler.runtime.metrics import SchedulerMetrics
from services.scheduler.runtime.outbox import OwnershipOutbox
from shared import records_proof, streams
from shared.config import Settings
from shared.messages.envelope import WireError
from shared.messages.ownership import RECORDS
from shared.placement import Placement, opened_mark
from shared.tenancy import Refused
from shared.tokenizer import Tokenizer

PROOF_WAIT_SECONDS = 10.0  # a move waits this long for the store to apply the records
RETRY_AFTER_SECONDS = 1  # a waiting request usually starts within a few steps


class FrontDoor:
    def __init__(
        self,
        settings: Settings,
        tokenizer: Tokenizer,
        engine: EngineCore,
        intake: Intake,
        link: ExecutorLink,
        metrics: SchedulerMetrics,
        redis: aioredis.Redis,
        outbox: OwnershipOutbox,
        grammars: GrammarChecks,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self._engine = engine
        self._intake = intake
        self._link = link
        self._metrics = metrics
        self._redis = redis
        self._outbox = outbox
        self._grammars = grammars

    # ---- what the edge reads ----
    @property
    def context_len(self) -> int:
        return self._engine.config.context_len

    @property
    def vocab_size(self) -> int:
        return self._engine.config.vocab_size

    @property
    def executor_epoch(self) -> str | None:
        return self._link.epoch

    def waiting_for(self) -> list[str]:
        """What this replica waits for before it can serve a request at once (none:
        ready): an executor warmed up and alive, and its lease on its sessions."""
        waits = [] if self._link.epoch is not None else ["executor"]
        return waits if self._engine.sessions.may_serve() else [*waits, "lease"]

    @property
    def sessions_open(self) -> int:
        return len(self._engine.sessions.sessions)

    @property
    def queued(self) -> int:
        """Requests waiting to be admitted."""
        return len(self._engine.waiting)

    @property
    def gen_throughput(self) -> float:
        """Tokens per second over the last decode steps (throughput.py)."""
        return self._intake.throughput.tokens_per_second

    @property
    def spec_accept_length(self) -> float:
        """Tokens a verify step gave on average, its accepted drafts and one more (1.0
        without speculation): SGLang's `avg_spec_accept_length`."""
        return self._engine.completion.accepted.mean_length

    def running_ids(self) -> list[str]:
        """Server ids of every request not yet ended (an operator's abort-all)."""
        return list(self._engine.requests)

    def session(self, sid: str) -> Session:
        """An open session; `SessionError` if it is unknown or closed."""
        return self._engine.sessions.get(sid)

    def sessions_of(self, tenant: str) -> int:
        return sum(1 for s in self._engine.sessions.sessions.values() if s.tenant == tenant)

    def idle_sessions(self, limit: int) -> list[dict]:
        """The `limit` longest idle sessions (no turn running): id, idle seconds, timeout."""
        return [
            {"session_id": s.sid, "idle_seconds": round(idle, 3), "timeout": s.timeout}
            for s, idle in self._engine.sessions.idle_sessions()[:limit]
        ]

    async def metrics(self) -> bytes:
        return await self._metrics.render(self._redis)

    # ---- what the edge does ----
    async def follow(self, turns: list[Turn]) -> AsyncIterator[list[Request]]:
        """`queue` `turns`, then their requests each time a step brought news of any,
        the last time once all ended (intake.py): the edge pulls its replies from here.
        Closing it early aborts them."""
        submitted = await self.queue(turns)  # no await after the submit: none is missed
        async with aclosing(self._intake.follow(submitted)) as updates:
            async for requests in updates:
                yield requests

    async def queue(self, turns: list[Turn]) -> list[Request]:
        """Queue `turns` (plain requests, or one session turn), all or none: a turn that
        cannot queue (a 400) takes back those queued before it. The caller then `watch`es
        them at once (no await in between), or they run with nobody to hear of them."""
        self._check_queue(len(turns))
        for turn in turns:  # a 400 before anything queues, if a grammar cannot compile
            if turn.params.grammar is not None:
                await self._grammars.check(turn.params.grammar)
            if turn.session is not None:
                await self._undo_stale_move(turn.session)
        submitted: list[Request] = []
        try:
            for turn in turns:
                submitted.append(self._submit(turn))
        except BaseException:
            for req in submitted:
                self._engine.abort(req.rid, "another request of its call was refused")
            self._intake.wake.set()
            raise
        return submitted

    def watch(self, requests: list[Request], notify: Callable[[], None]) -> None:
        """`notify` after each step that brought news of any of `requests` (`queue`d),
        until `release`: what `follow` is built on, for a caller that serves many calls
        without a task each (edge/core_side.py)."""
        self._intake.watch(requests, notify)

    def settled(self, requests: list[Request]) -> bool:
        """All `requests` ended and their clients may hear it (`SessionError` if a turn
        among them was refused after it ended)."""
        return self._intake.settled(requests)

    def release(self, requests: list[Request]) -> None:
        """Stop watching `requests`, aborting those not ended."""
        self._intake.release(requests)

    async def run(self, turns: list[Turn]) -> list[Request]:
        """`turns` run to their end (`follow`, when only the end is wanted)."""
        return await last_of(self.follow(turns))

    def _check_queue(self, count: int) -> None:
        """503 with Retry-After when `count` more requests (OpenAI's `n` choices, a batch's
        items: each is a request) would not fit in the waiting queue (0: no limit), so a
        call is refused whole; decided here, as every edge worker's requests share it."""
        limit, waiting = self.settings.max_queued_requests, self.queued
        if limit and waiting + count > limit:
            asked = "" if count == 1 else f"; this asks for {count} requests"
            raise Refused(
                503,
                f"{waiting} requests are waiting and this server queues {limit}{asked}; "
                f"retry in {RETRY_AFTER_SECONDS} s",
                "overloaded",
                {"Retry-After": str(RETRY_AFTER_SECONDS)},
            )

    def _submit(self, turn: Turn) -> Request:
        """Queue a plain request, or the next turn of its session (resolved by the edge:
        `tokens` are then only its new input), matching and feeding the prefix cache of
        its namespace."""
        tokens = np.asarray(turn.tokens, dtype=np.int64)
        if turn.session is None:
            plain = Request(turn.rid, tokens, turn.params, cache_namespace=turn.cache_namespace)
            return self._engine.submit(plain)
        return self._engine.submit_turn(
            turn.session,
            tokens,
            turn.rid,
            turn.params,
            turn.session_options,
            turn.chat,
            turn.cache_namespace,
        )

    def open_session(
        self, sid: str | None, timeout: float | None, tenant: str | None, streaming: bool = False
    ) -> Session:
        return self._engine.sessions.open(sid, timeout, tenant, streaming=streaming)

    @property
    def opened_mark(self) -> str:
        """The last open's number, for the router (shared/placement.py `OPENED_HEADER`)."""
        return opened_mark(self._link.scheduler_epoch, self._engine.sessions.opened)

    def fork_session(
        self, parent: Session, options: dict, open_child: Callable[[], Session]
    ) -> Session:
        """A session forked from `parent` (SessionManager.fork)."""
        return self._engine.sessions.fork(parent, options, open_child)

    def retain(self, session: Session, ttl: float, priority: int, label: str) -> None:
        """A retention hint for `session` (sessions/tier_policy.py `retain`), counted by
        its TTL's `label`."""
        self._engine.sessions.tiers.retain(session, ttl, priority)
        self._metrics.retention_hints.labels(label).inc()

    def delete_response(self, session: Session, rid: str) -> bool:
        """Response `rid` of `session` is named no more (records/response_tree.py); its
        record is written with the session's next."""
        deleted = session.responses.delete(rid)
        self._engine.sessions.dirty.add(session.sid)
        self._intake.wake.set()
        return deleted

    def reseed_session(self, session: Session) -> Session:
        """`session` empty again (SessionManager.reseed)."""
        reseeded = self._engine.sessions.reseed(session.sid)
        self._intake.wake.set()
        return reseeded

    def count_header_turn(self, outcome: str) -> None:
        """A chat request bound by the session header (http/header_sessions.py)."""
        self._metrics.header_turns.labels(outcome).inc()

    def forget_lost(self, sid: str) -> bool:
        """Whether `sid` was lost (SessionManager.lost): its close then takes away what
        is left of it."""
        forgotten = self._engine.sessions.forget_lost(sid)
        self._intake.wake.set()
        return forgotten

    async def close_session(self, session: Session) -> None:
        """Close `session` (resolved by the edge with `session`)."""
        await self._undo_stale_move(session)
        self._engine.sessions.close(session.sid)
        self._intake.wake.set()

    async def close_recorded(self, session: Session) -> None:
        """Until the close of `session` is on the ownership stream, and then only if it
        stands (protocol/copies.py, `close_stands`): a session moved meanwhile answers
        503 `moving`, and its client closes it where it went."""
        await self.durable()
        placed = Placement.decode(await self._redis.get(streams.placement_key(session.sid)))
        if not close_stands(session, placed, self._outbox.keys.replica):
            raise SessionError(
                f"session {session.name} moved to another replica while it closed here; "
                "close it again",
                "moving",
            )

    async def _undo_stale_move(self, session: Session) -> None:
        """A session marked moving whose placement names this replica and no target was
        moved back, or never left, by a router that could not tell this replica (it was
        restarting): it takes turns here again. The directory decides, as everywhere."""
        if not session.moving:
            return
        placed = Placement.decode(await self._redis.get(streams.placement_key(session.sid)))
        if settled_here(session, placed, self._outbox.keys.replica):
            self._engine.sessions.stay(session.sid)

    async def durable(self) -> None:
        """Until the sessions opened or closed so far are recorded on the ownership
        stream: their answer must not outrun their record (a scheduler killed in
        between would forget an open session, or bring back a closed one)."""
        self._intake.wake.set()
        await self._outbox.durable()

    async def place_session(self, sid: str, tier: str, timeout: float = 30.0) -> Session:
        """Move idle session `sid` to `tier`, a tier per step; returns it once there and
        written (the step carrying the move has run), or where it stopped (a tier without
        room) after `timeout` seconds."""
        session = self._engine.sessions.get(sid)
        if session.turn is not None:
            raise SessionError(f"session {sid} has a turn in flight", "busy")
        tiers = self._engine.sessions.tiers
        tiers.place(session, tier)
        deadline = time.monotonic() + timeout
        while (sid in tiers.placing or not session.state_ready) and time.monotonic() < deadline:
            self._intake.wake.set()
            await asyncio.sleep(0.002)
        tiers.placing.pop(sid, None)
        return session

    async def migrate_out(self, sid: str) -> Session | None:
        """Stop `sid`'s turns, place its state on disk, and return once its record (the
        one the replica it goes to reads) is persisted by the store. None: it was lost
        here, and leaves as lost (nothing to place: the replica it goes to finds it in
        this replica's `Keys.lost`), so a drain moves it like any other."""
        if sid in self._engine.sessions.lost:
            return None
        self._engine.sessions.leave(sid)
        session = await self.place_session(sid, "disk")
        await self.durable()
        await self._records_current(self._outbox.keys)
        return session

    async def _records_current(self, keys: streams.Keys) -> None:
        """Until the store has applied `keys`'s records up to the stream's end as it is now
        (shared/records_proof.py); a store that lags longer refuses the move, which the
        router undoes and tries again."""
        target = await records_proof.stream_end(self._redis, keys)
        if not await records_proof.wait_records_current(
            self._redis, keys, target, PROOF_WAIT_SECONDS
        ):
            raise SessionError("the session store is behind; retry the move", "moving")

    async def migrate_in(
        self, sid: str, source: str, epoch: int, move: str = "", timeout: float = 30.0
    ) -> Session | None:
        """Open `sid` at placement `epoch` from the record replica `source` persisted,
        its blob copied here, as attempt `move` of its move; returns once the copy ran
        (or failed: then it re-prefills) and it is recorded. Only while the directory has
        the session in transit from `source` to here: a request of a move undone since
        (delayed, or retried late) must not open a copy nobody will settle. None: the
        session was lost at `source` and arrived lost (`_arrive_lost`). The record
        is read only once proven current: a source that died (or paused) with records
        still unapplied would otherwise hand over an older history than the one it
        acknowledged."""
        placed = Placement.decode(await self._redis.get(streams.placement_key(sid)))
        if not takes_arrival(placed, source, epoch, self._outbox.keys.replica, move):
            raise SessionError(
                f"session {sid} is not moving from {source} to this replica "
                f"(placed: {None if placed is None else placed.encode()})",
                "conflict",
            )
        await self._records_current(streams.Keys(source))
        raw = await self._redis.hget(streams.Keys(source).session(sid), "record")
        if raw is None and await self._redis.sismember(streams.Keys(source).lost, sid):
            return await self._arrive_lost(sid, source, epoch)
        if raw is None:
            raise SessionError(f"replica {source} has no record of session {sid}", "not_found")
        try:
            record = RECORDS.decode(raw)
        except WireError as err:
            raise SessionError(f"the record of session {sid} is refused: {err}", "invalid") from err
        session = self._engine.sessions.arrive(record, source, epoch, move)
        deadline = time.monotonic() + timeout
        while not session.state_ready and time.monotonic() < deadline:
            self._intake.wake.set()
            await asyncio.sleep(0.002)
        await self.durable()
        return session

    async def _arrive_lost(self, sid: str, source: str, epoch: int) -> None:
        """A session the store lost moves as lost (its record is gone, its client must
        still hear `session_lost`): held here as lost at `epoch`, listed here, no longer
        listed at `source`."""
        self._engine.sessions.lost.add(sid, epoch)
        await self._redis.sadd(self._outbox.keys.lost, sid)
        await self._redis.srem(streams.Keys(source).lost, sid)

    async def migrate_cancel(self, sid: str) -> None:
        """The move of `sid` failed before its placement changed: it stays here, once
        the directory gives it back. A cancel that comes late, or for an attempt another
        has followed since (a front that took an undone move over), changes nothing: the
        move under way decides (protocol/copies.py, `settled_here`)."""
        await self._undo_stale_move(self._engine.sessions.get(sid))

    async def migrate_done(self, sid: str) -> None:
        """`sid` lives on another replica now: close it here. Refused while the placement
        directory puts it on this replica, or is moving it here."""
        placed = Placement.decode(await self._redis.get(streams.placement_key(sid)))
        if not may_close(placed, self._outbox.keys.replica):
            raise SessionError(f"session {sid} is placed on this replica", "busy")
        if self._engine.sessions.lost.pop(sid) is not None:
            return  # it was lost here, and moved on as lost
        self._engine.sessions.depart(sid)
        await self.durable()

    def abort(self, rids: list[str]) -> None:
        for rid in rids:
            self._intake.ended(self._engine.abort(rid, "aborted by request"))
        self._intake.wake.set()

    def flush_cache(self) -> tuple[int, int] | None:
        """Evict every unlocked prefix-cache entry, only when no request is queued or
        running (as SGLang does): None when some are, else the KV pages and Mamba states
        the cache still holds, borrowed by open sessions. A caller that times a recompute
        must learn of them: a request on those tokens would still hit."""
        if self._engine.requests:
            return None
        cache, pools = self._engine.cache, self._engine.pools
        cache.evict_kv(pools.kv_pages.capacity)
        cache.evict_mamba(pools.mamba.capacity)
        held = cache.sizes()
        return held["evictable_pages"] + held["protected_pages"], held["states"]


async def last_of(updates: AsyncIterator[list[Request]]) -> list[Request]:
    """A door's `follow` to its end: the requests as they ended."""
    ended: list[Request] = []
    async with aclosing(updates):
        async for requests in updates:
            ended = requests
    return ended
