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
from collections.abc import Awaitable, Callable

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
        self.waiters: dict[str, tuple[Request, asyncio.Event]] = {}
        self.timing: dict[str, list] = {}  # rid -> [arrival, time of the last token]
        self.throughput = RecentThroughput()  # of the last steps (/server_info)
        self.unannounced: list[Request] = []  # ended, records not yet taken
        self.recorded_ends: list[Request] = []  # ended, records taken, not yet flushed
        # rid -> (session error kind, why): its end must not be acknowledged
        self.refused: dict[str, tuple[str, str]] = {}

    async def run(
        self,
        submitted: Request,
        progress: Callable[[Request], Awaitable[None]] | None = None,
    ) -> Request:
        """Wait for the end of `submitted`, just queued in the engine (no await in
        between), calling `progress` as tokens arrive; a cancelled wait (the client went
        away) aborts the request."""
        event = asyncio.Event()
        self.waiters[submitted.rid] = (submitted, event)
        self.timing[submitted.rid] = [time.monotonic(), None]
        self.wake.set()
        try:
            while (
                not submitted.done
                or submitted in self.unannounced
                or submitted in self.recorded_ends
            ):
                await event.wait()
                event.clear()
                if progress is not None:
                    await progress(submitted)
            refused = self.refused.get(submitted.rid)
            if refused is not None:
                raise SessionError(refused[1], refused[0])
            return submitted
        finally:
            self.refused.pop(submitted.rid, None)
            self.waiters.pop(submitted.rid, None)
            self.timing.pop(submitted.rid, None)
            if not submitted.done:
                self.ended(self.engine.abort(submitted.rid, "client disconnected"))
                self.wake.set()

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
        waiter = self.waiters.get(rid)
        if waiter is not None:
            waiter[1].set()
