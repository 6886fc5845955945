"""The scheduler service: the engine core driven by an asyncio loop, talking to the
executor over Redis streams, shipping ownership events, serving the HTTP API.

Pipelined: with `pipeline_depth` 1 the loop plans and publishes step N+1 before it
waits for the result of step N, so the executor finds the next step on the stream as soon
as it is done, and the scheduler's planning, its Redis round trips and the completion of
N overlap the forward of N+1 (see engine/core.py for why that is safe). When the
executor's epoch changes, its device state is gone: the engine re-queues what ran and
sessions rebuild from their history.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from aiohttp import web

from services.scheduler.api import build_app
from services.scheduler.engine.misroute import MisrouteWrite
from services.scheduler.engine.setup import build_engine
from services.scheduler.engine.step import StepPlan
from services.scheduler.event_shipper import EventShipper
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.records.request import Request
from services.scheduler.session_rebuild import rebuild_sessions
from services.scheduler.slow_clients import GuardedRunner
from services.scheduler.tenancy import Tenancy
from shared import streams
from shared.config import Settings
from shared.model_config import ModelConfig, builtin_config
from shared.tokenizer import load_tokenizer
from shared.wire import WireError, decode, encode, unpack_ints

log = logging.getLogger("custody.scheduler")


class SchedulerService:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.model = (
            builtin_config() if settings.model is None else ModelConfig.from_dir(settings.model)
        )
        self.tokenizer = load_tokenizer(settings.model, self.model.eos_token_id)
        self.engine = build_engine(settings, self.model, self.tokenizer, strict=False)
        self.pools = self.engine.pools
        self.misroute = MisrouteWrite.from_env(self.pools.mamba)  # a test-only fault hook
        self.shipper = EventShipper(self.pools.ledger)
        self.tenancy = Tenancy(settings.api_keys, settings.admin_api_keys)
        self.waiters: dict[str, tuple[Request, asyncio.Event]] = {}
        self.timing: dict[str, list] = {}  # rid -> [arrival, time of the last token]
        self.executor_losses = 0
        self.loop_faults = 0  # faults of the loop itself, survived (device-lost path)
        self.stream_lag: dict[str, int] = {}
        self.metrics = SchedulerMetrics(self)
        self.wake = asyncio.Event()
        self.executor_epoch: str | None = None
        self.redis: aioredis.Redis | None = None
        self.results: aioredis.Redis | None = None  # its own connection: it blocks
        self._results_from = "0-0"
        self._next_snapshot_check = 0.0
        self._outbox: list[bytes] = []  # ownership messages numbered, not yet on the stream
        self._finished: list[Request] = []  # ended, not yet announced to their clients
        self._was_idle = True

    # ---- intake, used by the API ----
    async def run_request(
        self,
        req: Request,
        submit: Callable[[Request], Request],
        progress: Callable[[Request], Awaitable[None]] | None = None,
    ) -> Request:
        """Submit and wait for the end, calling `progress` as tokens arrive; a cancelled
        wait (the client went away) aborts the request."""
        submitted = submit(req)
        event = asyncio.Event()
        self.waiters[submitted.rid] = (submitted, event)
        self.timing[submitted.rid] = [time.monotonic(), None]
        self.wake.set()
        try:
            while not submitted.done or submitted in self._finished:  # not yet announced
                await event.wait()
                event.clear()
                if progress is not None:
                    await progress(submitted)
            return submitted
        finally:
            self.waiters.pop(submitted.rid, None)
            self.timing.pop(submitted.rid, None)
            if not submitted.done:
                self.finish(self.engine.abort(submitted.rid, "client disconnected"))
                self.wake.set()

    def finish(self, ended: list[Request]) -> None:
        now = time.monotonic()
        for req in ended:
            start = self.timing.get(req.rid)
            if start is not None:
                self.metrics.e2e.observe(now - start[0])
            self._notify(req.rid)

    def _tokens_arrived(self, rids: list[str]) -> None:
        now = time.monotonic()
        for rid in rids:
            seen = self.timing.get(rid)
            if seen is not None:
                (self.metrics.ttft if seen[1] is None else self.metrics.itl).observe(
                    now - (seen[0] if seen[1] is None else seen[1])
                )
                seen[1] = now
            self._notify(rid)

    def _notify(self, rid: str) -> None:
        waiter = self.waiters.get(rid)
        if waiter is not None:
            waiter[1].set()

    # ---- the loop ----
    async def start(self) -> None:
        self.redis = aioredis.from_url(self.settings.redis_url)
        self.results = aioredis.from_url(self.settings.redis_url)
        # Fencing: from now on the executor refuses steps of any earlier scheduler life.
        await self.redis.set(streams.SCHEDULER_EPOCH, self.shipper.epoch)
        epoch = await rebuild_sessions(self.redis, self.engine.sessions)
        if epoch is not None:
            self.executor_epoch = epoch
        self._outbox.append(self.shipper.snapshot())
        await self._flush_outbox()
        # Read results from an explicit id, never "$": a result that lands between
        # publishing a step and starting to read must not be missed.
        last = await self.redis.xrevrange(streams.RESULTS, count=1)
        self._results_from = last[0][0] if last else "0-0"

    async def loop(self) -> None:
        while True:
            try:
                await self.step()
            except (ConnectionError, aioredis.ConnectionError, OSError) as err:
                log.warning("redis unavailable (%s); retrying", err)
                if self.engine.in_flight:
                    # whether the executor ran the step is unknown: its state is not trusted
                    self._executor_lost(None, suspect=False)
                await asyncio.sleep(0.5)
            except Exception:  # a fault no single request can be blamed for: never exit
                log.exception("fault in the scheduler loop; device state treated as lost")
                self.loop_faults += 1
                self._executor_lost(self.executor_epoch, suspect=False)
                await asyncio.sleep(0.1)

    async def step(self) -> None:
        """Plan and publish a step if the pipeline has room; then, unless there is room
        for one more, complete the oldest step in flight and publish the next at once,
        before anything else may wait (streaming replies, events, heartbeats)."""
        started = time.perf_counter()
        engine, depth = self.engine, self.settings.pipeline_depth
        if not engine.in_flight:  # with steps in flight, _await_result watches the executor
            await self._check_executor()
        await self._ship_events()
        plan = await self._publish_next()
        if not engine.in_flight:
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=self.settings.heartbeat_seconds)
            return
        if plan is not None and len(engine.in_flight) <= depth:
            self.metrics.step.observe(time.perf_counter() - started)
            return
        await self._complete_oldest()
        self.metrics.step.observe(time.perf_counter() - started)

    async def _publish_next(self) -> StepPlan | None:
        """Plan a step and put it on the stream, if the pipeline has room for it. The
        ownership messages of the planning go first, in the same round trip (write-ahead):
        a slot a session released is never written by a published step before the record
        saying so is on the ownership stream, so a scheduler restarted in between cannot
        rebuild the session on overwritten slots."""
        if self.executor_epoch is None or len(self.engine.in_flight) > self.settings.pipeline_depth:
            return None
        plan = self.engine.plan_step()
        if plan is None:
            return None
        try:
            message = encode("step", self.shipper.epoch, plan.step_id, self._wire(plan))
        except (ValueError, TypeError, OverflowError) as err:  # what msgpack raises
            log.error("step %s could not be encoded: %s", plan.step_id, err)
            self.finish(self.engine.step_unsent(plan, str(err)))
            return None
        self._queue_ownership()
        await self._flush_outbox(step=message)
        return plan

    async def _complete_oldest(self) -> None:
        engine = self.engine
        plan = engine.in_flight[0]
        result = await self._await_result(plan)
        if result is None or not engine.in_flight or engine.in_flight[0] is not plan:
            return  # the executor was lost meanwhile: everything in flight was abandoned
        if result.get("error"):
            log.error("step %s refused by the executor: %s", plan.step_id, result["error"])
            self.finish(engine.step_refused(plan, result["error"], bool(result.get("ops_ran"))))
            return
        tokens = unpack_ints(result["tokens"], "<i4").tolist()
        logprobs = unpack_ints(result["logprobs"], "<f4").tolist()
        arrived = [row.rid for row in plan.rows if row.sample and not row.dropped]
        ended = self.engine.complete_step(
            plan,
            dict(zip(result["rids"], tokens, strict=True)),
            dict(zip(result["rids"], logprobs, strict=True)),
        )
        self._finished += ended  # announced once their session records are on the stream
        done = {req.rid for req in ended}
        await self._publish_next()
        self._tokens_arrived([rid for rid in arrived if rid not in done])
        if ended:
            await self._ship_events()

    def _wire(self, plan: StepPlan) -> dict:
        # called right after plan_step, before any await: see StepPlan.wire_body
        return plan.wire_body(self.executor_epoch, self.pools, self.misroute)

    async def _await_result(self, plan: StepPlan) -> dict | None:
        """The step's result, or None once the executor that was to run it is gone."""
        deadline = time.monotonic() + self.settings.executor_timeout_seconds
        while True:
            reply = await self.results.xread(
                {streams.RESULTS: self._results_from}, count=8, block=200
            )
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    self._results_from = entry_id
                    try:
                        msg = decode(fields[b"m"])
                    except (WireError, KeyError):
                        continue
                    if (
                        msg.get("step") == plan.step_id
                        and msg.get("scheduler_epoch") == self.shipper.epoch
                        and msg.get("executor_epoch") == self.executor_epoch
                    ):
                        return msg
            if reply and time.monotonic() < deadline:
                continue  # results are flowing: ask after the executor only when they stop
            alive = await self.redis.get(streams.EXECUTOR_ALIVE)
            if alive is not None and alive.decode() == self.executor_epoch:
                deadline = time.monotonic() + self.settings.executor_timeout_seconds
            elif time.monotonic() > deadline or alive is not None:
                log.error("executor %s lost during step %s", self.executor_epoch, plan.step_id)
                self._executor_lost(alive.decode() if alive else None)
                return None

    async def _check_executor(self) -> None:
        alive = await self.redis.get(streams.EXECUTOR_ALIVE)
        epoch = alive.decode() if alive else None
        if epoch is not None and epoch != self.executor_epoch:
            if self.executor_epoch is not None:
                self._executor_lost(epoch)
            else:
                self.executor_epoch = epoch
                log.info("executor %s is up", epoch)

    def _executor_lost(self, new_epoch: str | None, suspect: bool = True) -> None:
        """Its device state is gone: re-queue what ran (failing poison, engine/faults.py),
        sessions rebuild from history."""
        self.finish(self.engine.device_lost(suspect))
        self.executor_losses += 1
        self.executor_epoch = new_epoch
        log.warning("device state lost; running work re-queued, sessions will re-prefill")

    def _queue_ownership(self) -> None:
        """Put the ledger's new transfers and the changed session records in the outbox."""
        shipped = self.shipper.batch()
        if shipped is not None:
            self._outbox.append(shipped[0])
        records = self.engine.sessions.take_records()
        if records:
            self._outbox.append(self.shipper.sessions(records, self.executor_epoch))

    async def _ship_events(self) -> None:
        """Drain the ledger and, on becoming idle, take its counts, with no await in
        between: an API handler running during an await could move slots, and the idle
        counts would then be ahead of the events shipped before them."""
        self._queue_ownership()
        idle = self.engine.idle
        if idle and not self._was_idle:
            self._outbox.append(self.shipper.idle(self.engine.audit().counts))
        self._was_idle = idle
        if time.monotonic() >= self._next_snapshot_check:  # not urgent: once a heartbeat
            self._next_snapshot_check = time.monotonic() + self.settings.heartbeat_seconds
            if await self.redis.exists(streams.SNAPSHOT_WANTED):
                self._outbox.append(self.shipper.snapshot())
        await self._flush_outbox()

    async def _flush_outbox(self, step: bytes | None = None) -> None:
        """Put every ownership message not yet on the stream there, in order, then tell
        the clients of requests that finished before it. A message leaves the outbox only
        once Redis has taken it: a send that fails (Redis restarting) is retried, never
        skipped, since the store would see a gap in the sequence (a resent message that
        Redis had taken is a duplicate the store drops); and a finished turn is announced
        only once its session record is on the stream, so a scheduler restarted after the
        reply still knows that history. A `step` goes on the forward stream after them, in
        the same round trip."""
        if self._outbox or step is not None:
            pipe = self.redis.pipeline(transaction=False)
            for message in self._outbox:
                pipe.xadd(
                    streams.OWNERSHIP,
                    {"m": message},
                    maxlen=self.settings.stream_maxlen,
                    approximate=True,
                )
            if step is not None:
                pipe.xadd(
                    streams.FORWARD,
                    {"m": step},
                    maxlen=self.settings.stream_maxlen,
                    approximate=True,
                )
            await pipe.execute()
            self._outbox.clear()
        finished, self._finished = self._finished, []
        self._tokens_arrived([req.rid for req in finished])
        self.finish(finished)


async def serve(settings: Settings) -> None:
    service = SchedulerService(settings)
    await service.start()
    app = build_app(service)
    runner = GuardedRunner(app, settings.read_timeout_seconds, settings.keepalive_seconds)
    await runner.setup()
    await web.TCPSite(runner, settings.host, settings.port).start()
    log.info("API listening on http://%s:%d", settings.host, settings.port)
    await service.loop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="custody scheduler service")
    Settings.add_arguments(parser)
    settings = Settings.resolve(parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(message)s")
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
