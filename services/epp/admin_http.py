"""The picker's HTTP port, beside its gRPC: `/metrics` for Prometheus, `/health` and
`/liveness` for whoever probes over HTTP, and `POST /admin/drain` (an operator key):
the drain a replica pod's preStop hook asks for (`custody drain`), moving every session
off that replica with its state, as the router's `/admin/drain` does."""

from __future__ import annotations

from aiohttp import web

from services.epp.metrics import PickerMetrics
from shared.routing.migration import Mover
from shared.routing.replicas import ReplicaTable
from shared.tenancy import ApiKeys, Refused


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind}}, status=status)


def admin_app(
    table: ReplicaTable, mover: Mover, tenancy: ApiKeys, metrics: PickerMetrics
) -> web.Application:
    async def render_metrics(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), content_type="text/plain")

    async def health(request: web.Request) -> web.Response:
        ready = len(table.ready())
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def liveness(request: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def drain(request: web.Request) -> web.Response:
        try:
            operator = tenancy.identify(request).operator
        except Refused as refused:
            return refused.response()
        if not operator:
            return _error(403, "/admin/drain needs an operator key", "permission_error")
        try:
            body = await request.json()
        except ValueError:
            body = None
        replica = body.get("replica") if isinstance(body, dict) else None
        if not isinstance(replica, str) or replica not in table.known:
            return _error(404, f"no replica {replica!r}", "not_found")
        return web.json_response(await mover.drain(replica))

    app = web.Application(client_max_size=1 << 16)
    app.router.add_get("/metrics", render_metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/liveness", liveness)
    app.router.add_post("/admin/drain", drain)
    return app
