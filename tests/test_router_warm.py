"""The router opens its connections to a replica before that replica counts as ready
(services/router/proxy.py, `Proxy.warm`), bounded: a replica that accepts connections
and never answers must not hold the registration reads that wait for the warm-up."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from fronts.replicas import Replica, ReplicaTable
from services.router.metrics import RouterMetrics
from services.router.proxy import WARM_SECONDS, Proxy
from shared.redis_server import free_port


def test_warming_a_replica_that_never_answers_ends_within_its_bound():
    async def scenario() -> float:
        released = asyncio.Event()

        async def hang(request: web.Request) -> web.Response:
            await released.wait()  # until the test is over
            return web.Response()

        app = web.Application()
        app.router.add_get("/liveness", hang)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        proxy = Proxy(RouterMetrics(ReplicaTable(None, 1.0)))
        await proxy.start()
        replica = Replica("h", f"http://127.0.0.1:{port}", True, 0, 0, 0, "e")
        started = time.monotonic()
        await asyncio.wait_for(proxy.warm(replica), WARM_SECONDS + 5)  # unbounded: fails
        took = time.monotonic() - started
        released.set()
        await proxy.close()
        await runner.cleanup()
        return took

    assert asyncio.run(scenario()) < WARM_SECONDS + 1
