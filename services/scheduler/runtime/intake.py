"""Requests on their way in and their clients waiting for the way out: submit, wait for
tokens and the end, and the latencies each client sees. A finished request is announced
only once its records are on the ownership stream (`hold`; `recorded` once the outbox
has taken the records; `announce` after it flushed them), so a scheduler restarted after
the reply still knows that history. A replica whose lease lapsed takes no records
(protocol/lives.py): its finished turns wait, and those of a session that moved meanwhile
are refused (`refuse_turns`), never acknowledged."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from services.scheduler.engine.core import EngineCore
from services.scheduler.records.request import Request
from services.scheduler.records.session import Session, SessionError
from services.scheduler.runtime.metrics import SchedulerMetrics
from services.scheduler.runtime.throughput import RecentThroughput


class Intake:
    def __init__(self, engine: EngineCore, metrics: SchedulerMetrics, wake: asyncio.Event) -> None:
        self.engine = engine
        self.metrics = metrics
        self.wake = wake  # set whenever the step loop has something new to do
        self.waiters: dict[str, Callable[[], None]] = {}  # rid -> what tells its caller
        self.timing: dict[str, list] = {}  # rid -> [arrival, time of the last token]
        self.throughput = RecentThroughput()  # of the last steps (/server_info)
        self.unannounced: list[Request] = []  # ended, records not yet taken
        self.recorded_ends: list[Request] = []  # ended, records not yet flushed
        # rid -> (session error kind, why): its end must not be acknowledged
        self.refused: dict[str, tuple[str, str]] = {}

    def watch(self, submitted: list[Request], notify: Callable[[], None]) -> None:
        """Call `notify` each time a step brings news of any of `submitted` (just queued
        in the engine), until `release`; a caller checks `settled` on each. A callback,
        not a task: a step's news reaches every caller without a task switch per call."""
        now = time.monotonic()
        for req in submitted:
            self.waiters[req.rid] = notify
            self.timing[req.rid] = [now, None]
        self.wake.set()

    def settled(self, submitted: list[Request]) -> bool:
        """Whether all of `submitted` ended and were announced; `SessionError` if a turn
        among them was refused after it ended (its end must not be acknowledged)."""
        if any(self._unannounced(req) for req in submitted):
            return False
        for req in submitted:
            refused = self.refused.get(req.rid)
            if refused is not None:
                raise SessionError(refused[1], refused[0])
        return True

    def release(self, submitted: list[Request]) -> None:
        """Stop watching `submitted`, aborting those not ended (their caller left)."""
        aborted = []
        for req in submitted:
            self.refused.pop(req.rid, None)
            self.waiters.pop(req.rid, None)
            self.timing.pop(req.rid, None)
            if not req.done:
                aborted += self.engine.abort(req.rid, "client disconnected")
        if aborted:
            self.ended(aborted)
            self.wake.set()

    async def follow(self, submitted: list[Request]) -> AsyncIterator[list[Request]]:
        """`submitted` (`watch`), each time a step brought news of any of them, the last
        time once all are `settled`. A generator closed or cancelled before that (the
        client went away) aborts those not ended."""
        event = asyncio.Event()
        self.watch(submitted, event.set)
        try:
            while True:
                settled = self.settled(submitted)
                if not settled:
                    await event.wait()
                    event.clear()
                    settled = self.settled(submitted)
                yield submitted
                if settled:
                    return
        finally:
            self.release(submitted)

    def _unannounced(self, req: Request) -> bool:
        """Its client may not hear of its end yet (records not on the stream)."""
        return not req.done or req in self.unannounced or req in self.recorded_ends

    def ended(self, requests: list[Request]) -> None:
        """Tell the clients of `requests` that they ended (records already shipped)."""
        now = time.monotonic()
        for req in requests:
            start = self.timing.get(req.rid)
            if start is not None:
                self.metrics.e2e.observe(now - start[0])
            self._notify(req.rid)

    def hold(self, requests: list[Request]) -> None:
        """`requests` ended in a step; their clients hear it at the next `announce`."""
        self.unannounced += requests

    def recorded(self) -> None:
        """The outbox took the records of every request held so far."""
        self.recorded_ends += self.unannounced
        self.unannounced = []

    def announce(self) -> None:
        """The outbox flushed: the recorded requests' records are on the stream."""
        held, self.recorded_ends = self.recorded_ends, []
        self.tokens_arrived([req.rid for req in held])
        self.ended(held)

    def refuse_turns(self, session: Session) -> None:
        """`session` left this replica while its lease lapsed. Its turn in flight and
        its finished turns whose records were not taken end unapplied (503, `moving`):
        the replica it went to never saw them. A finished turn whose record was written
        while the lease lapsed may or may not be in the history the move carried: it
        ends `outcome_unknown` (the client re-reads the session rather than assume)."""
        sid = session.sid
        unapplied = [r for r in self.unannounced if r.session is session]
        if session.turn is not None:
            unapplied.append(session.turn)
        unknown = [r for r in self.recorded_ends if r.session is session]
        for req in unapplied:
            self.refused[req.rid] = ("moving", f"session {sid} moved to another replica; retry")
        for req in unknown:
            self.refused[req.rid] = (
                "outcome_unknown",
                f"session {sid} moved to another replica while this turn's record was on "
                "its way: the turn may or may not be in its history; read it before going on",
            )
        self.unannounced = [r for r in self.unannounced if r.session is not session]
        self.recorded_ends = [r for r in self.recorded_ends if r.session is not session]
        self.ended(unapplied + unknown)

    def tokens_arrived(self, rids: list[str]) -> None:
        """A step brought tokens for `rids`: wake their clients, and observe each one's
        time to first token or gap since its last (one histogram update per step)."""
        now = time.monotonic()
        firsts, gaps = [], []
        for rid in rids:
            seen = self.timing.get(rid)
            if seen is not None:
                if seen[1] is None:
                    firsts.append(now - seen[0])
                else:
                    gaps.append(now - seen[1])
                seen[1] = now
            self._notify(rid)
        self.metrics.ttft.observe_many(firsts)
        self.metrics.itl.observe_many(gaps)

    def _notify(self, rid: str) -> None:
        notify = self.waiters.get(rid)
        if notify is not None:
            notify()
