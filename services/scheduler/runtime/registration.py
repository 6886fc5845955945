"""The replica's registration: where its API listens and how loaded it is, under an
expiring key the router reads (shared/streams.py `Keys.alive`). A replica whose key has
expired gets no new work from the router; one whose scheduler is up but has no executor
says so, and the router sends it nothing either."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections import Counter

import redis.asyncio as aioredis

from services.scheduler.engine.core import EngineCore
from services.scheduler.runtime.executor_link import ExecutorLink
from shared import streams
from shared.config import Settings

log = logging.getLogger("custody.scheduler")


def advertised_url(settings: Settings) -> str:
    """The address other processes reach this API at: the bound host, or this machine's
    name when bound to every interface (a container's name on its network)."""
    host = settings.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://{host}:{settings.port}"


class Registration:
    def __init__(
        self, settings: Settings, keys: streams.Keys, engine: EngineCore, link: ExecutorLink
    ) -> None:
        self.keys, self.engine, self.link = keys, engine, link
        self.url = advertised_url(settings)
        self.period = settings.heartbeat_seconds
        self.ttl_ms = int(3 * settings.heartbeat_seconds * 1000)

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
                "tenants": Counter(
                    s.tenant for s in engine.sessions.sessions.values() if s.tenant is not None
                ),
                "at": time.time(),
            }
        )

    async def run(self, client: aioredis.Redis) -> None:
        """Beat once a heartbeat, forever; Redis away is logged and retried."""
        while True:
            try:
                await client.sadd(streams.REPLICAS, self.keys.replica)
                await client.set(self.keys.alive, self.entry(), px=self.ttl_ms)
            except (ConnectionError, aioredis.ConnectionError, OSError) as err:
                log.warning("registration not written (%s); retrying", err)
            await asyncio.sleep(self.period)
