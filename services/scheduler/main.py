"""The scheduler's composition root: build the engine and the four parts that drive it
(intake, step loop, ownership outbox, executor link), the façade the HTTP edge calls,
and serve. Every other module receives what it needs from here and constructs nothing of
another's."""

from __future__ import annotations

import asyncio
import logging
import tempfile
from pathlib import Path

import redis.asyncio as aioredis
from aiohttp import web

from services.scheduler.edge.core_side import EdgeLink
from services.scheduler.edge.workers import EdgeWorkers
from services.scheduler.engine.setup import build_engine
from services.scheduler.http.app import build_app
from services.scheduler.http.tenancy import Tenancy
from services.scheduler.runtime.cache_shipper import CacheShipper
from services.scheduler.runtime.event_shipper import EventShipper
from services.scheduler.runtime.executor_link import ExecutorLink
from services.scheduler.runtime.front_door import FrontDoor
from services.scheduler.runtime.grammar_checks import GrammarChecks
from services.scheduler.runtime.intake import Intake
from services.scheduler.runtime.metrics import LiveState, SchedulerMetrics
from services.scheduler.runtime.outbox import OwnershipOutbox
from services.scheduler.runtime.registration import Registration
from services.scheduler.runtime.session_rebuild import finish_rebuild, start_life
from services.scheduler.runtime.step_loop import StepLoop
from shared import streams
from shared.config import Settings
from shared.model_config import ModelConfig, builtin_config
from shared.redis_client import connect_async
from shared.retry import DEPENDENCY_FAULTS, Retry
from shared.service_main import start
from shared.slow_clients import GuardedRunner
from shared.tokenizer import load_tokenizer

log = logging.getLogger("custody.scheduler")


class Scheduler:
    @classmethod
    async def connect(cls, settings: Settings) -> Scheduler:
        """A scheduler on the Redis (or Redis Cluster) of `settings`, once it answers
        (its faults until then are logged, not counted: there are no metrics yet)."""
        retry = Retry("scheduler_start", log)
        while True:
            try:
                redis = await connect_async(settings.redis_url)
            except DEPENDENCY_FAULTS as err:
                await retry.wait(err)
                continue
            return cls(settings, redis)

    def __init__(self, settings: Settings, redis: aioredis.Redis) -> None:
        self.settings = settings
        model = builtin_config() if settings.model is None else ModelConfig.from_dir(settings.model)
        tokenizer = load_tokenizer(settings.model, settings.tokenizer)
        self.engine = build_engine(settings, model, tokenizer, strict=False)
        self.redis = redis
        self.keys = streams.Keys(settings.replica)
        shipper = EventShipper(self.engine.pools.ledger)
        self.link = ExecutorLink(shipper.epoch, settings.executor_timeout_seconds, self.keys)
        self.outbox = OwnershipOutbox(
            self.engine,
            shipper,
            settings.stream_maxlen,
            settings.heartbeat_seconds,
            self.keys,
            CacheShipper(self.engine.cache, shipper.epoch),
        )
        metrics = SchedulerMetrics(self.keys)
        self.intake = Intake(self.engine, metrics, asyncio.Event())
        self.loop = StepLoop(
            settings, self.engine, self.link, self.outbox, self.intake, metrics, self.redis
        )
        metrics.watch(LiveState(self.engine, self.link, self.outbox, lambda: self.loop.faults))
        self.front_door = FrontDoor(
            settings,
            tokenizer,
            self.engine,
            self.intake,
            self.link,
            metrics,
            self.redis,
            self.outbox,
            GrammarChecks(self.redis, self.keys),
        )
        self.tenancy = Tenancy(settings.api_keys, settings.admin_api_keys)
        self.registration = Registration(settings, self.keys, self.engine, self.link, self.intake)
        lease = self.registration.lease
        self.engine.sessions.may_serve = self.outbox.may_record = lease.current
        self.unproven: str | None = None  # the stream entry sessions in doubt wait for

    async def finish_rebuild(self) -> None:
        """Take back the sessions that waited for the store's proof, then send the store
        the full set of records (withheld until now: queue_snapshot)."""
        retry = Retry("scheduler_start", log, self.loop.metrics.faults)
        while self.unproven is not None:
            try:
                await finish_rebuild(self.redis, self.engine.sessions, self.keys, self.unproven)
            except DEPENDENCY_FAULTS as err:
                await retry.wait(err)
                continue
            self.unproven = None
            self.outbox.queue_snapshot(self.link.epoch)
            self.intake.wake.set()

    async def fence(self) -> None:
        """From now on the executor refuses steps of any earlier scheduler life. Waits
        out a Redis that is away or refuses writes (a scheduler that exited instead would
        only be restarted into the same refusal, again and again)."""
        retry = Retry("scheduler_start", log, self.loop.metrics.faults)
        while True:
            try:
                await self.redis.set(self.keys.scheduler_epoch, self.outbox.shipper.epoch)
                return
            except DEPENDENCY_FAULTS as err:
                await retry.wait(err)

    async def start(self) -> None:
        """This life's first steps (protocol/lives.py: fence earlier lives and register
        this one, its lease running from there; take the sessions back), then announce
        the ledger."""

        async def register() -> None:
            await self.fence()
            await self.registration.register(self.redis)

        epoch, self.unproven = await start_life(
            self.redis, self.engine.sessions, self.keys, register
        )
        await self.redis.delete(self.keys.draining)  # a restarted replica takes work again
        if epoch is not None:
            self.link.epoch = epoch
        self.outbox.queue_snapshot(self.link.epoch)
        self.outbox.queue_cache_snapshot()  # a router drops what it had of an earlier epoch
        await self.registration.beat(self.redis)  # the lease, before the first request
        await self.loop.flush()
        await self.link.start(self.settings.redis_url, self.redis)


async def serve(settings: Settings) -> None:
    scheduler = await Scheduler.connect(settings)
    await scheduler.start()
    app = build_app(scheduler.front_door, scheduler.tenancy)
    runner = GuardedRunner(app, settings.read_timeout_seconds, settings.keepalive_seconds)
    await runner.setup()
    with tempfile.TemporaryDirectory(prefix="custody-edge-") as sockets:
        edge = EdgeLink(scheduler.front_door, scheduler.tenancy, scheduler.loop.metrics)
        workers = await serve_http(scheduler, runner, edge, Path(sockets))
        faults = scheduler.loop.metrics.faults
        beating = asyncio.create_task(scheduler.registration.run(scheduler.redis, faults))
        rebuilding = asyncio.create_task(scheduler.finish_rebuild())
        try:
            await scheduler.loop.run()
        finally:
            beating.cancel()
            rebuilding.cancel()
            if workers is not None:
                await workers.stop()


async def serve_http(
    scheduler: Scheduler, runner: web.AppRunner, edge: EdgeLink, sockets: Path
) -> EdgeWorkers | None:
    """The API on the public port: in this process (`--api-workers 0`), or in edge
    worker processes that forward what is the core's to this application, served on a
    Unix socket in `sockets` beside the edge link's."""
    settings = scheduler.settings
    if settings.edge_workers == 0:
        await web.TCPSite(runner, settings.host, settings.port).start()
        log.info("API listening on http://%s:%d", settings.host, settings.port)
        return None
    core_http, link = sockets / "core.sock", sockets / "link.sock"
    await web.UnixSite(runner, str(core_http)).start()
    await edge.serve(link)
    exits = scheduler.loop.metrics.edge_worker_exits
    workers = EdgeWorkers(settings, settings.edge_workers, link, core_http, exits)
    workers.start()
    log.info("API on http://%s:%d by %d edge workers", settings.host, settings.port, workers.count)
    return workers


def main(argv: list[str] | None = None) -> None:
    asyncio.run(serve(start("scheduler", argv)))


if __name__ == "__main__":
    main()
