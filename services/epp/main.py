"""The endpoint picker service: what a Kubernetes gateway (Gateway API Inference
Extension) asks, per request, which replica should serve it (services/epp/ext_proc.py),
deciding as the custody router decides (fronts/). Its only state is in Redis (the
registrations, the placement directory, the replicas' prefix feeds), so several pickers
run at once and any of them may restart: each answers picks; the duties one front does
at a time (taking over moves, re-homing a dead replica's sessions, forgetting long-dead
ones) go to whichever front holds their lease (fronts/migration.py).

Three ports: ext_proc gRPC (`--epp-port`), gRPC health (`--epp-health-port`: the
services `liveness`, `readiness` and the ext_proc service's own name, also answered on
the ext_proc port), and HTTP (`--epp-http-port`: /metrics, POST /admin/drain)."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fronts.background import Background
from fronts.decision import Decision
from fronts.front import Routing, refuse_keys_without_secret, replica_table
from fronts.replicas import ReplicaTable
from services.epp.admin_http import admin_app
from services.epp.ext_proc import ExternalProcessor
from services.epp.metrics import PickerMetrics
from shared.config import Settings
from shared.redis_client import connect_async, warm_async
from shared.service_main import start

log = logging.getLogger("custody.epp")
WARM_REDIS_CONNECTIONS = 16
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_SERVICES = ("readiness", EXT_PROC_SERVICE, "")


async def _grpc_server(
    port: int, host: str, health_servicer: health.aio.HealthServicer
) -> grpc.aio.Server:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise SystemExit(f"the endpoint picker cannot listen on {host}:{port}")
    return server


async def _report_health(table: ReplicaTable, servicer: health.aio.HealthServicer) -> None:
    """Ready while a registration read has succeeded lately (its view of the replicas is
    current: Redis answers); alive while the process answers at all."""
    await servicer.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    while True:
        fresh = time.monotonic() - table.last_read < 5 * table.period + 2
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if fresh
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in READY_SERVICES:
            await servicer.set(service, status)
        await asyncio.sleep(table.period)


async def serve(settings: Settings) -> None:
    refuse_keys_without_secret(settings, "picker")
    client = await connect_async(settings.redis_url)
    await warm_async(client, WARM_REDIS_CONNECTIONS)
    table, metrics = replica_table(settings, client), PickerMetrics()
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
    routing = Routing.of(settings, table, metrics.prefix, session)
    metrics.watch(routing.index)
    await table.refresh()
    background = Background(metrics.faults)
    picker = Decision(
        routing, background.run, settings.session_header, settings.max_queued_requests
    )
    health_servicer = health.aio.HealthServicer()
    ext_proc = await _grpc_server(settings.epp_port, settings.host, health_servicer)
    ext_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(picker, metrics), ext_proc)
    probes = await _grpc_server(settings.epp_health_port, settings.host, health_servicer)
    admin = admin_app(table, picker, metrics)
    runner = web.AppRunner(admin, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, settings.host, settings.epp_http_port).start()
    await ext_proc.start()
    await probes.start()
    log.info(
        "endpoint picker: ext_proc on %s:%d, health on :%d, http on :%d",
        settings.host,
        settings.epp_port,
        settings.epp_health_port,
        settings.epp_http_port,
    )
    tasks = [
        *routing.loops(metrics.faults),
        asyncio.create_task(_report_health(table, health_servicer)),
    ]
    try:
        await table.run(metrics.faults)
    finally:
        for task in tasks:
            task.cancel()
        await ext_proc.stop(grace=1)
        await probes.stop(grace=1)
        await runner.cleanup()
        await session.close()


def main(argv: list[str] | None = None) -> None:
    asyncio.run(serve(start("epp", argv)))


if __name__ == "__main__":
    main()
