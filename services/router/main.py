"""The router service: one HTTP front for every replica (services/router/app.py). Its
state is in Redis (the replicas' registrations, the placement directory), so it can be
killed and restarted alone, or run twice, and sends every session to the same place."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from services.router.app import Router
from services.router.metrics import RouterMetrics
from services.router.proxy import Proxy
from shared.config import Settings
from shared.http_limits import MAX_BODY
from shared.redis_client import connect_async, warm_async
from shared.routing.choice import Chooser
from shared.routing.directory import Directory
from shared.routing.limits import SessionLimits
from shared.routing.migration import Mover
from shared.routing.prefix_feed import PrefixFeed
from shared.routing.prefix_index import PrefixIndex
from shared.routing.replicas import ReplicaTable
from shared.service_main import start
from shared.slow_clients import GuardedRunner
from shared.tenancy import ApiKeys
from shared.tokenizer import load_tokenizer

log = logging.getLogger("custody.router")
WARM_REDIS_CONNECTIONS = 16  # the directory's, for a burst of opens


async def serve(settings: Settings) -> None:
    if settings.api_keys.strip() and not settings.cluster_secret:
        raise SystemExit(
            "--api-keys without --cluster-secret: the router would send API keys to "
            "whatever address a Redis registration names; set --cluster-secret (the same "
            "on every replica) too"
        )
    client = await connect_async(settings.redis_url)
    await warm_async(client, WARM_REDIS_CONNECTIONS)  # before it listens: no cold connect
    table = ReplicaTable(
        client,
        period=min(0.5, settings.heartbeat_seconds),
        secret=settings.cluster_secret,
        settle=3 * settings.heartbeat_seconds + 0.5,
    )
    metrics, index = RouterMetrics(table), PrefixIndex()
    metrics.watch(index)
    proxy = Proxy(metrics, settings.session_header)
    await proxy.start()
    table.warm = proxy.warm  # a replica is ready once this router's connections are open
    await table.refresh()
    tokenizer = load_tokenizer(settings.model, settings.tokenizer)  # as the replicas tokenize
    chooser = Chooser(
        table, index, tokenizer, settings.context_len, metrics.prefix, settings.router_policy
    )
    tenancy = ApiKeys(settings.api_keys, settings.admin_api_keys)
    directory = Directory(client, lease_seconds=settings.replica_dead_seconds)
    admin_key = next((k.strip() for k in settings.admin_api_keys.split(",") if k.strip()), None)
    mover = Mover(
        table,
        directory,
        proxy.session,
        admin_key,
        settings.replica_dead_seconds,
        settings.replica_forget_seconds,
    )
    limits = SessionLimits(table, settings.max_sessions_per_key, settings.max_sessions)
    router = Router(
        table, directory, proxy, tenancy, chooser, mover, limits, settings.session_header
    )
    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_route("*", "/{tail:.*}", router.handle)
    runner = GuardedRunner(
        app, settings.read_timeout_seconds, settings.keepalive_seconds, access_log=None
    )
    await runner.setup()
    await web.TCPSite(runner, settings.host, settings.port).start()
    log.info("router listening on http://%s:%d", settings.host, settings.port)
    feeding = asyncio.create_task(PrefixFeed(client, table, index).run(metrics.faults))
    watching = asyncio.create_task(mover.watch(metrics.faults))
    try:
        await table.run(metrics.faults)
    finally:
        feeding.cancel()
        watching.cancel()
        await proxy.close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    asyncio.run(serve(start("router", argv)))


if __name__ == "__main__":
    main()
