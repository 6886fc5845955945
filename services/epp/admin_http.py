"""The picker's HTTP port, beside its gRPC: `/metrics` for Prometheus, `/health` and
`/liveness` for whoever probes over HTTP, and `POST /admin/drain` (an operator key):
the drain a replica pod's preStop hook asks for (`custody drain`), moving every session
off that replica with its state, as the router's `/admin/drain` does."""

from __future__ import annotations

from aiohttp import web

from fronts.decision import Decision, Refusal
from fronts.replicas import ReplicaTable
from services.epp.metrics import PickerMetrics


def admin_app(table: ReplicaTable, decision: Decision, metrics: PickerMetrics) -> web.Application:
    async def render_metrics(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), content_type="text/plain")

    async def health(request: web.Request) -> web.Response:
        ready = len(table.ready())
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def liveness(request: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def drain(request: web.Request) -> web.Response:
        try:
            return web.json_response(await decision.drain(request.headers, await request.read()))
        except Refusal as refusal:
            return web.Response(
                status=refusal.status,
                body=refusal.body(),
                headers=refusal.headers,
                content_type="application/json",
            )

    app = web.Application(client_max_size=1 << 16)
    app.router.add_get("/metrics", render_metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/liveness", liveness)
    app.router.add_post("/admin/drain", drain)
    return app
