"""The step loop: plan and publish steps, await their results, complete them, and watch
the executor.

Pipelined: with `pipeline_depth` 1 the loop plans and publishes step N+1 before it waits
for the result of step N, so the executor finds the next step on the stream as soon as it
is done, and the scheduler's planning, its Redis round trips and the completion of N
overlap the forward of N+1 (engine/in_flight.py says why that is safe). When the
executor's epoch changes, its device state is gone: the engine re-queues what ran and
sessions rebuild from their history. The loop never exits: a fault no request can be
blamed for takes the device-lost path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from services.scheduler.engine.core import EngineCore
from services.scheduler.engine.misroute import MisrouteWrite
from services.scheduler.engine.step import StepPlan
from services.scheduler.runtime.executor_link import ExecutorLink, ExecutorLost
from services.scheduler.runtime.intake import Intake
from services.scheduler.runtime.metrics import SchedulerMetrics
from services.scheduler.runtime.outbox import OwnershipOutbox
from shared.config import Settings
from shared.messages.envelope import encode
from shared.retry import DEPENDENCY_FAULTS, Retry

log = logging.getLogger("custody.scheduler")


@dataclass(eq=False)
class StepLoop:
    settings: Settings
    engine: EngineCore
    link: ExecutorLink
    outbox: OwnershipOutbox
    intake: Intake
    metrics: SchedulerMetrics
    redis: aioredis.Redis
    faults: int = 0  # faults of the loop itself, survived (device-lost path)
    misroute: MisrouteWrite = field(init=False)  # a test-only fault hook

    def __post_init__(self) -> None:
        self.misroute = MisrouteWrite.from_env(self.engine.pools.mamba)

    async def run(self) -> None:
        """Step forever. Redis away or refusing (any error class, shared/retry.py) is
        waited out; a fault of the loop itself takes the device-lost path. Both are
        counted, logged and retried with backoff."""
        retry = Retry("step_loop", log, self.metrics.faults)
        while True:
            try:
                await self.step()
            except DEPENDENCY_FAULTS as err:
                if self.engine.in_flight:
                    # whether the executor ran the step is unknown: its state is not trusted
                    self.executor_lost(None, suspect=False)
                await retry.wait(err)
                continue
            except Exception as err:  # a fault no single request can be blamed for
                self.faults += 1
                self.executor_lost(self.link.epoch, suspect=False)
                await retry.wait(err)
                continue
            retry.ok()

    async def step(self) -> None:
        """Plan and publish a step if the pipeline has room; then, unless there is room
        for one more, complete the oldest step in flight and publish the next at once,
        before anything else may wait (streaming replies, events, heartbeats)."""
        started = time.perf_counter()
        engine, depth = self.engine, self.settings.pipeline_depth
        if not engine.in_flight:  # with steps in flight, await_result watches the executor
            await self.check_executor()
        await self.ship_events()
        plan = await self.publish_next()
        if not engine.in_flight:
            self.intake.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self.intake.wake.wait(), timeout=self.settings.heartbeat_seconds
                )
            return
        if plan is None or len(engine.in_flight) > depth:
            await self.complete_oldest()
        self.metrics.step.observe(time.perf_counter() - started)

    async def publish_next(self) -> StepPlan | None:
        """Plan a step and put it on the stream, its ownership messages first in the same
        round trip (write-ahead, outbox.py), if the pipeline has room for it."""
        if self.link.epoch is None or len(self.engine.in_flight) > self.settings.pipeline_depth:
            return None
        plan = self.engine.plan_step()
        if plan is None:
            return None
        try:  # right after planning, before any await: see StepPlan.message
            step = plan.message(
                self.outbox.shipper.epoch, self.link.epoch, self.engine.pools, self.misroute
            )
            message = encode(step)
        except (ValueError, TypeError, OverflowError) as err:  # what the encoder raises
            log.error("step %s could not be encoded: %s", plan.step_id, err)
            self.intake.ended(self.engine.step_unsent(plan, str(err)))
            return None
        if self.outbox.queue_ownership(self.link.epoch):
            self.intake.recorded()
        await self.flush(step=message)
        return plan

    async def complete_oldest(self) -> None:
        engine = self.engine
        plan = engine.in_flight[0]
        try:
            result = await self.link.await_result(self.redis, plan)
        except ExecutorLost as lost:
            self.executor_lost(lost.alive)
            return
        if not engine.in_flight or engine.in_flight[0] is not plan:
            return  # the executor was lost meanwhile: everything in flight was abandoned
        received = time.perf_counter()
        arrived = [row.rid for row in plan.rows if row.sample and not row.dropped]
        ended = engine.complete(plan, result)
        self.intake.throughput.add(len(arrived))
        self.intake.hold(ended)  # announced once their session records are on the stream
        done = {req.rid for req in ended}
        if await self.publish_next() is not None:
            self.metrics.turnaround.observe(time.perf_counter() - received)
        self.intake.tokens_arrived([rid for rid in arrived if rid not in done])
        if ended:
            await self.ship_events()

    async def check_executor(self) -> None:
        epoch = await self.link.alive_epoch(self.redis)
        if epoch is not None and epoch != self.link.epoch:
            if self.link.epoch is not None:
                self.executor_lost(epoch)
            else:
                self.link.epoch = epoch
                log.info("executor %s is up", epoch)

    def executor_lost(self, new_epoch: str | None, suspect: bool = True) -> None:
        """Its device state is gone: re-queue what ran (failing poison, engine/faults.py),
        sessions rebuild from history."""
        self.intake.ended(self.engine.device_lost(suspect))
        self.link.losses += 1
        self.link.epoch = new_epoch
        log.warning("device state lost; running work re-queued, sessions will re-prefill")

    async def ship_events(self) -> None:
        if await self.outbox.queue_all(self.redis, self.link.epoch):
            self.intake.recorded()
        await self.flush()

    async def flush(self, step: bytes | None = None) -> None:
        """The outbox (and `step`) onto the streams, then tell the clients of requests
        whose records went with it, if the lease still holds now that Redis has answered:
        then the records were applied before any router could begin to move their
        sessions. A record delayed on its way (a slow network) may have reached Redis
        after; its answer waits for the directory check (directory_check.py)."""
        await self.outbox.flush(self.redis, step)
        if self.outbox.may_record():
            self.intake.announce()
