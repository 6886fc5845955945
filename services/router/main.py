"""The router service: one HTTP front for every replica (services/router/app.py). Its
state is in Redis (the replicas' registrations, the placement directory), so it can be
killed and restarted alone, or run twice, and sends every session to the same place."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from fronts.background import Background
from fronts.decision import Decision
from fronts.front import Routing, refuse_keys_without_secret, replica_table
from services.router.app import Router
from services.router.metrics import RouterMetrics
from services.router.proxy import Proxy
from shared.config import Settings
from shared.http_limits import MAX_BODY
from shared.redis_client import connect_async, warm_async
from shared.service_main import start
from shared.slow_clients import GuardedRunner

log = logging.getLogger("custody.router")
WARM_REDIS_CONNECTIONS = 16  # the directory's, for a burst of opens


async def serve(settings: Settings) -> None:
    refuse_keys_without_secret(settings, "router")
    client = await connect_async(settings.redis_url)
    await warm_async(client, WARM_REDIS_CONNECTIONS)  # before it listens: no cold connect
    table = replica_table(settings, client)
    metrics = RouterMetrics(table)
    proxy = Proxy(metrics, settings.session_header)
    await proxy.start()
    routing = Routing.of(settings, table, metrics.prefix, proxy.session)
    decision = Decision(routing, Background(metrics.faults).run, settings.session_header)
    metrics.watch(routing.index, decision.declared_dead)
    table.warm = proxy.warm  # a replica is ready once this router's connections are open
    await table.refresh()
    router = Router(decision, table, routing.tenancy, proxy)
    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_route("*", "/{tail:.*}", router.handle)
    runner = GuardedRunner(
        app, settings.read_timeout_seconds, settings.keepalive_seconds, access_log=None
    )
    await runner.setup()
    await web.TCPSite(runner, settings.host, settings.port).start()
    log.info("router listening on http://%s:%d", settings.host, settings.port)
    loops = routing.loops(metrics.faults)
    try:
        await table.run(metrics.faults)
    finally:
        for loop in loops:
            loop.cancel()
        await proxy.close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    asyncio.run(serve(start("router", argv)))


if __name__ == "__main__":
    main()
