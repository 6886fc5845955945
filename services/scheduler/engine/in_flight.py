"""The steps published and not yet completed, oldest first, and the one way a request's
rows in them stop counting.

Up to the pipeline's depth (a running request's working slots less one) steps may be in
flight while the next is planned. Why that is
safe: the executor runs steps, and the deferred ops of each step, in the order they were
planned. A slot the scheduler frees or reassigns while a step is in flight is only ever
written for its new owner by a later step, after the in-flight one has finished with it.
What the scheduler must never do is hand a long-lived owner (a session, the prefix cache)
a slot that a step in flight will still change: a request's rows step around a ring of
working slots (working_slots.py), snapshots go to a track slot no step in flight writes,
and a request that ends, aborts or is re-queued first drops its rows still in flight
(`unplan`), so their effects never count.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from services.scheduler.allocators.pools import Pools
from services.scheduler.cache.radix_cache import RadixCache
from services.scheduler.engine.step import StepPlan
from services.scheduler.records.request import Request
from services.scheduler.sessions.records import DurableRecords


class InFlight:
    def __init__(self, pools: Pools, cache: RadixCache, records: DurableRecords) -> None:
        """`records`: told which Mamba slots the copies of steps in flight write."""
        self.pools, self.cache, self.records = pools, cache, records
        self.plans: deque[StepPlan] = deque()
        self.dropped_rows = 0  # planned rows that will not count: pipelining's wasted work

    def __len__(self) -> int:
        return len(self.plans)

    def __getitem__(self, i: int) -> StepPlan:
        return self.plans[i]

    def __iter__(self) -> Iterator[StepPlan]:
        return iter(self.plans)

    def check_room(self) -> None:
        """Refuse to plan beyond the depth the working slots allow: one step in flight per
        spare working slot."""
        if len(self.plans) >= self.pools.config.working_slots:
            raise RuntimeError(f"{len(self.plans)} steps are in flight already")

    @property
    def last_step(self) -> int | None:
        """The step a step planned now builds on."""
        return self.plans[-1].step_id if self.plans else None

    def add(self, plan: StepPlan) -> None:
        self.plans.append(plan)
        self.records.copying([dst for _, dst in plan.ops.copies])

    def check_oldest(self, plan: StepPlan) -> None:
        if not self.plans or plan is not self.plans[0]:
            raise RuntimeError(f"step {plan.step_id} is not the oldest step in flight")

    def pop_oldest(self, plan: StepPlan) -> None:
        """`plan` ran: its copy sources may go."""
        self.check_oldest(plan)
        self.plans.popleft()
        for node in plan.copy_sources:
            self.cache.unlock_copy(node)
        self.records.copied([dst for _, dst in plan.ops.copies])

    def unplan(self, req: Request) -> None:
        """Drop `req`'s rows still in flight: their snapshots are cancelled, the KV given
        to them is trimmed (page-aligned), its state is what its last completed step left."""
        self.dropped_rows += len(req.inflight)
        for row in req.inflight:
            row.dropped = True
            if row.snapshot_slot:
                req.slots.track.cancel(row.snapshot_slot)
        req.inflight = []
        req.slots.state.rewind()
        self.pools.kv.free_tail(req.slots.row.slot, req.computed, "unplan")

    def since(self, first: StepPlan | None = None) -> list[StepPlan]:
        """The steps in flight from `first` on (default: all), oldest first."""
        keep = 0 if first is None else next(i for i, p in enumerate(self.plans) if p is first)
        return list(self.plans)[keep:]

    def abandon(
        self, requests: dict[str, Request], first: StepPlan | None = None
    ) -> list[StepPlan]:
        """No step in flight from `first` on (default: the oldest) will complete: forget
        them, as if never planned; returns them, oldest first."""
        plans = self.since(first)
        for _ in plans:
            self.plans.pop()
        for plan in plans:
            for node in plan.copy_sources:
                self.cache.unlock_copy(node)
            self.records.copied([dst for _, dst in plan.ops.copies])
            for row in plan.rows:
                if not row.dropped:
                    self.unplan(requests[row.rid])
        return plans
