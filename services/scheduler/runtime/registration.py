"""The replica's registration: where its API listens and how loaded it is, under an
expiring key the router reads (shared/streams.py `Keys.alive`). A replica whose key has
expired gets no new work from the router; one whose scheduler is up but has no executor
says so, and the router sends it nothing either. Each registration written renews the
replica's lease on its sessions (protocol/lives.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections import Counter

import prometheus_client
import redis.asyncio as aioredis

from protocol.lives import ReplicaLease
from services.scheduler.engine.core import EngineCore
from services.scheduler.runtime.directory_check import release_moved, settle
from services.scheduler.runtime.executor_link import ExecutorLink
from services.scheduler.runtime.intake import Intake
from services.scheduler.runtime.placed_sweep import PlacedSweep
from shared import streams
from shared.config import Settings
from shared.placement import UNPLACE, Placement
from shared.registration_auth import signature
from shared.retry import Retry

log = logging.getLogger("custody.scheduler")


def advertised_url(settings: Settings) -> str:
    """The address other processes reach this API at: the advertised host if set (a
    pod's IP), else the bound host, or this machine's name when bound to every interface
    (a container's name on its network)."""
    host = settings.advertise_host or settings.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://{host}:{settings.port}"


class Registration:
    def __init__(
        self,
        settings: Settings,
        keys: streams.Keys,
        engine: EngineCore,
        link: ExecutorLink,
        intake: Intake,
    ) -> None:
        self.keys, self.engine, self.link, self.intake = keys, engine, link, intake
        self.url = advertised_url(settings)
        self.secret = settings.cluster_secret
        self.period = settings.heartbeat_seconds
        self.ttl_ms = int(3 * settings.heartbeat_seconds * 1000)
        self.lease = ReplicaLease(
            settings.replica_dead_seconds, settings.heartbeat_seconds, time.monotonic
        )
        self.sweep = PlacedSweep(keys, engine.sessions)

    def entry(self) -> str:
        engine = self.engine
        return json.dumps(
            {
                "replica": self.keys.replica,
                "url": self.url,
                "executor": self.link.epoch is not None,
                "running": len(engine.running),
                "queued": len(engine.waiting),
                "sessions": len(engine.sessions.sessions),
                "opened": engine.sessions.opened,  # so a router knows which opens it has
                "tenants": Counter(
                    s.tenant for s in engine.sessions.sessions.values() if s.tenant is not None
                ),
                "at": time.time(),
                "epoch": self.link.scheduler_epoch,
                "sig": signature(
                    self.secret, self.keys.replica, self.url, self.link.scheduler_epoch
                ),
            }
        )

    async def run(self, client: aioredis.Redis, faults: prometheus_client.Counter) -> None:
        """Beat once a heartbeat, forever. A fault (Redis away or refusing writes, or one
        of its own) is counted in `faults`, logged and retried (shared/retry.py): were
        this loop to end, the replica would serve on while the router sends it nothing."""
        retry = Retry("registration", log, faults, ceiling=self.period)
        while True:
            try:
                await self.beat(client)
            except Exception as err:
                await retry.wait(err)
                continue
            retry.ok()
            await asyncio.sleep(self.period)

    async def register(self, client: aioredis.Redis) -> float:
        """Write the registration; returns when it was sent. A new life does this first
        of all, before it reads the sessions it holds: from that write on, a pause long
        enough for a router to re-home them lapses its lease (and fences it), as it
        would for a life that has served for hours."""
        sent = self.lease.clock()
        if self.lease.lapsed_at(sent) and not self.lease.fenced:
            self.lease.fenced = True
            log.warning("lease lapsed: sessions refused until checked against the directory")
        await client.sadd(streams.REPLICAS, self.keys.replica)
        await client.set(self.keys.alive, self.entry(), px=self.ttl_ms)
        if self.lease.renewed_at is None:
            self.lease.renew(sent)
        return sent

    async def beat(self, client: aioredis.Redis) -> None:
        """Write the registration; renew the lease, unless it had lapsed: then, fenced,
        check every held session against the directory first (directory_check.py), once
        no router is re-homing this replica's sessions any more."""
        sent = await self.register(client)
        if self.lease.fenced:
            if await client.exists(self.keys.rehoming):
                return  # a router is moving them now: check once it is done
            if not await release_moved(client, self.engine, self.intake, self.keys.replica):
                return  # a move carries a session held here: checked again next beat
            log.info("sessions checked against the directory: serving again")
        self.lease.renew(sent)
        self.intake.wake.set()  # records held while fenced may go now
        await self.unplace(client)
        await self.sweep.step(client)
        await settle(client, self.engine, self.intake, self.keys.replica)

    async def unplace(self, client: aioredis.Redis) -> None:
        """Take away the placement of each routed session closed here, if it still names
        this replica at the session's epoch (a compare-and-delete), and then its listing:
        the router that closed it removes them too, but may die first, and an idle
        timeout tells no router. A placement that is not that one now (in transit: a move
        that will be undone, the copy it would carry being closed) keeps its listing, so
        the sweep (placed_sweep.py) settles it once it stops changing; taken away here,
        the placement the undone move put back was listed nowhere, for good."""
        sessions = self.engine.sessions
        if not sessions.unplaced:
            return
        script = client.register_script(UNPLACE)
        while sessions.unplaced:
            sid, epoch = sessions.unplaced[0]
            mine = Placement(self.keys.replica, epoch).encode()
            if await script(keys=[streams.placement_key(sid)], args=[mine]):
                await client.srem(self.keys.placed, sid)
            await client.srem(self.keys.lost, sid)  # if it was lost, its client closed it
            sessions.unplaced.pop(0)
