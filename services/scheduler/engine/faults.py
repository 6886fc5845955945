"""What the core does when a step does not run as planned: the executor refused it, or
the executor (with its device state) was lost.

Two facts make this safe.
- A refusal says whether the step's deferred ops ran (the executor validates the whole
  step before it applies any op, then applies them all, then runs the forward). A copy
  that did not run leaves its destination unwritten; so does every copy of a later step
  (the executor refuses every step built on a refused one, before its ops). The only
  long-lived holder a copy writes is a session's rollback slot, so every session whose
  state would be such a slot gives up its state and re-prefills its history: never an
  unwritten slot as a session's state.
- A request whose step was the one executing when the executor was lost twice is
  *poison* until proven otherwise: it is failed with an error instead of being retried
  a third time, so one request cannot crash-loop every new executor.
"""

from __future__ import annotations

import logging

from services.scheduler.allocators.pools import Pools
from services.scheduler.cache.radix_cache import RadixCache
from services.scheduler.engine.endings import Endings
from services.scheduler.engine.in_flight import InFlight
from services.scheduler.engine.queue import RequestQueue
from services.scheduler.engine.step import StepPlan
from services.scheduler.records.request import Request
from services.scheduler.sessions.manager import SessionManager

log = logging.getLogger("custody.engine")
POISON_LOSSES = 2  # executor losses during a request's step before it is failed


class Faults:
    def __init__(
        self,
        pools: Pools,
        cache: RadixCache,
        sessions: SessionManager,
        in_flight: InFlight,
        queue: RequestQueue,
        endings: Endings,
    ) -> None:
        self.pools, self.cache, self.sessions = pools, cache, sessions
        self.in_flight, self.queue, self.endings = in_flight, queue, endings
        self.quarantined = 0  # requests failed as poison

    def refuse_step(self, plan: StepPlan, error: str, ops_ran: bool) -> list[Request]:
        """`plan` will not run (the executor refused it, or it could not be sent), and so
        neither will any step planned on top of it: the requests of `plan` end with the
        error, those only in later steps are re-queued (they re-prefill, as their
        admission's state ops may not have run). Steps before `plan` still run. Returns the
        requests that ended."""
        plans = self.in_flight.since(plan)
        unwritten = {dst for p in (plans[1:] if ops_ran else plans) for _, dst in p.ops.copies}
        live = [{row.rid for row in p.rows if not row.dropped} for p in plans]
        for abandoned in self.in_flight.abandon(self.queue.by_rid, plan):
            self.sessions.moves.abandon(abandoned.tier)
        refused, later = live[0], set().union(*live[1:])
        ended = []
        for rid in refused:
            ended += self.endings.abort(rid, error)
        for rid in later - refused:
            self.endings.retract(self.queue.by_rid[rid])
        self.sessions.drop_state_in(unwritten)
        return ended

    def lose_device(self, suspect: bool = True) -> list[Request]:
        """The executor restarted with empty pools: every slot's contents are gone. Running
        requests are re-queued (they re-prefill what they had, tokens already produced
        included), sessions keep their history and a valid blob on disk but no other
        state, and the prefix cache is emptied. With `suspect`, the requests of the step
        that was executing count one loss each; at `POISON_LOSSES` they are failed
        (quarantined). Returns those."""
        executing = self.in_flight[0] if suspect and self.in_flight else None
        suspects = [] if executing is None else [r.rid for r in executing.rows if not r.dropped]
        for abandoned in self.in_flight.abandon(self.queue.by_rid):
            self.sessions.moves.abandon(abandoned.tier)
        ended = []
        for rid in suspects:
            req = self.queue.by_rid.get(rid)
            if req is None:
                continue
            req.executor_losses += 1
            if req.executor_losses >= POISON_LOSSES:
                log.error(
                    "request %s quarantined: its step was executing at %d executor losses",
                    rid,
                    req.executor_losses,
                )
                self.quarantined += 1
                ended += self.endings.abort(
                    rid,
                    f"quarantined: the executor was lost {req.executor_losses} times while "
                    "running this request's step; it is not retried",
                )
        for req in reversed(list(self.queue.running)):
            self.endings.retract(req)
        self.sessions.drop_volatile_state()
        self.cache.evict_kv(self.pools.kv_pages.capacity)
        self.cache.evict_mamba(self.pools.mamba.capacity)
        self.pools.rows.unsync()  # a new executor holds no page table
        return ended
