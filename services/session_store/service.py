"""The session store service: replays every replica's ownership stream into that
replica's independent ledger (replicas.py), checks every forward step's writes against it,
and serves what it knows over HTTP (`/ledger`, `/ledger/replicas` and `/sessions/{id}` for
operators, `/health`, `/metrics`) on `store_host`, loopback unless asked."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from services.session_store.auth import operator_keys
from services.session_store.metrics import LedgerMetrics
from services.session_store.replicas import ReplicaConsumers
from shared import streams
from shared.config import Settings
from shared.messages.envelope import WireError
from shared.messages.ownership import RECORDS
from shared.placement import Placement
from shared.redis_client import connect
from shared.retry import Retry, when_up
from shared.service_main import start

log = logging.getLogger("custody.session_store")
# Each replica's loop holds a thread while its read blocks: room for many replicas' reads
# beside discovery's (threads are started only as they are needed).
MAX_THREADS = 64


class StoreService:
    def __init__(self, settings: Settings) -> None:
        starting = Retry("store_start", log)  # no metrics yet: logged, not counted
        self.client = when_up(lambda: connect(settings.redis_url), starting)
        self.replica = settings.replica  # the store's own: what /ledger shows unasked
        self.replicas = when_up(lambda: ReplicaConsumers(self.client, settings.replica), starting)
        self.registry = CollectorRegistry()
        self.registry.register(LedgerMetrics(self.replicas))

    def ledger_view(self, replica: str | None = None) -> dict:
        """One replica's ledger (the store's own unless named); KeyError if unknown."""
        replica = self.replica if replica is None else replica
        consumer = self.replicas.consumers[replica]
        led = consumer.ledger
        counts, leaked = led.held_view() if led.ready else ({}, {})
        return {
            "ready": led.ready,
            "epoch": consumer.epoch,
            "events_applied": led.events_applied,
            "counts": counts,
            "leaked": leaked,
            "double_free_total": led.double_frees,
            "violations": [v.as_dict() for v in led.violations[-100:]],
            "violations_total": dict(led.found),
            "owners_known": len(led.owners.names),
            "consumer_faults": self.replicas.faults[replica],
            "refused": {"total": consumer.refused, "last": consumer.last_refused},
            "fenced_records": consumer.fenced,
            "sessions_lost": consumer.sessions_lost,
            "steps": {
                "checked": consumer.checker.checked,
                "unchecked": consumer.checker.unchecked,
                "queued": len(consumer.checker.queued),
            },
        }

    def replica_of(self, sid: str) -> str:
        """The replica a session lives on: the router's placement, else the store's own
        (a single replica's stack has no router, so places nothing)."""
        placed = Placement.decode(self.client.get(streams.placement_key(sid)))
        return self.replica if placed is None else placed.replica

    def metrics(self) -> bytes:
        return generate_latest(self.registry)


def not_found(message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "not_found"}}, status=404)


def session_body(raw: bytes) -> web.Response:
    """A persisted session record as JSON (500 if the record does not decode)."""
    try:
        rec = RECORDS.decode(raw)
    except WireError as err:
        return web.json_response(
            {"error": {"message": str(err), "type": "malformed_record"}}, status=500
        )
    history = rec.tokens()
    return web.json_response(
        {
            "session_id": rec.sid,
            "history_tokens": len(history),
            "history": history.tolist(),
            "cached_len": rec.cached_len,
            "row": rec.row,
            "working_slot": rec.working,
            "kv_pages": rec.kv_pages().tolist(),
            "executor": rec.executor,
            "chat": None if rec.chat is None else [[e.digest, e.end] for e in rec.chat],
        }
    )


def build_app(store: StoreService, admin_api_keys: str = "") -> web.Application:
    app = web.Application(middlewares=[operator_keys(admin_api_keys)])

    async def ledger(request: web.Request) -> web.Response:
        replica = request.query.get("replica", store.replica)
        if replica not in store.replicas.consumers:
            return not_found(f"no ledger of replica {replica!r}")
        return web.json_response(store.ledger_view(replica))

    async def every_ledger(_: web.Request) -> web.Response:
        ids = sorted(store.replicas.consumers)
        return web.json_response({"replicas": {r: store.ledger_view(r) for r in ids}})

    async def health(_: web.Request) -> web.Response:
        ready = store.replicas.consumers[store.replica].ledger.ready
        return web.json_response({"status": "ok", "ready": ready})

    async def session(request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        raw = store.client.hget(streams.Keys(store.replica_of(sid)).session(sid), "record")
        return not_found("no such open session") if raw is None else session_body(raw)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=store.metrics(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/ledger", ledger)
    app.router.add_get("/ledger/replicas", every_ledger)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/sessions/{sid}", session)
    return app


async def serve(settings: Settings) -> None:
    store = StoreService(settings)
    runner = web.AppRunner(build_app(store, settings.admin_api_keys))
    await runner.setup()
    await web.TCPSite(runner, settings.store_host, settings.store_port).start()
    log.info("session store on http://%s:%d", settings.store_host, settings.store_port)
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(MAX_THREADS))
    await store.replicas.run_forever()


def main(argv: list[str] | None = None) -> None:
    asyncio.run(serve(start("session-store", argv)))


if __name__ == "__main__":
    main()
