"""The session store service: replays the ownership stream into the independent ledger,
checks every forward step's writes against it, and serves what it knows over HTTP
(`/ledger` and `/sessions/{id}` for operators, `/health`, `/metrics`) on `store_host`,
loopback unless asked."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import signal

import redis
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from services.session_store.auth import operator_keys
from services.session_store.consumer import OwnershipConsumer
from services.session_store.ledger_replay import KINDS
from shared import streams
from shared.config import Settings
from shared.messages.envelope import WireError
from shared.messages.ownership import RECORDS

log = logging.getLogger("custody.session_store")


class StoreService:
    def __init__(self, settings: Settings) -> None:
        self.client = redis.Redis.from_url(settings.redis_url)
        # A stable name: a restarted store resumes its own pending entries first.
        self.keys = streams.Keys(settings.replica)
        self.consumer = OwnershipConsumer(self.client, "session-store-1", keys=self.keys)
        self.faults = 0  # exceptions survived by the consuming loop
        self.registry = CollectorRegistry()
        self.violations = Gauge(
            "custody_ledger_violations",
            "ownership violations found",
            ["kind"],
            registry=self.registry,
        )
        self.leaked = Gauge(
            "custody_ledger_leaked_slots",
            "slots held by running work at idle",
            ["pool"],
            registry=self.registry,
        )
        self.applied = Gauge(
            "custody_ledger_events_applied", "ownership events replayed", registry=self.registry
        )
        self.refused = Gauge(
            "custody_ownership_messages_refused",
            "ownership stream entries refused as malformed (acknowledged, snapshot asked)",
            registry=self.registry,
        )
        self.steps = Gauge(
            "custody_ledger_steps_checked",
            "forward steps whose writes were checked against the ledger, or could not be",
            ["result"],
            registry=self.registry,
        )

    async def consume_forever(self) -> None:
        led = self.consumer.ledger
        reported = led.found.total()  # those loaded were logged before
        while True:
            try:
                await asyncio.to_thread(self.consumer.poll, 500)
                await asyncio.to_thread(self.consumer.claim_stale, 10_000)
            except redis.ConnectionError as err:
                log.warning("redis unavailable (%s); retrying", err)
                await asyncio.sleep(0.5)
            except Exception:  # a bad entry must not stop the ledger: say so, go on
                log.exception("fault while applying the ownership stream")
                self.faults += 1
                await asyncio.sleep(0.5)
            new = led.found.total() - reported
            for v in led.violations[-new:] if new else []:
                log.error("ownership violation %s on %s %s: %s", v.kind, v.pool, v.slots, v.detail)
            reported += new

    def ledger_view(self) -> dict:
        led = self.consumer.ledger
        return {
            "ready": led.ready,
            "epoch": self.consumer.epoch,
            "events_applied": led.events_applied,
            "counts": led.counts() if led.ready else {},
            "leaked": led.leaked() if led.ready else {},
            "double_free_total": led.double_frees,
            "violations": [v.as_dict() for v in led.violations[-100:]],
            "violations_total": dict(led.found),
            "owners_known": len(led.owners.names),
            "consumer_faults": self.faults,
            "refused": {"total": self.consumer.refused, "last": self.consumer.last_refused},
            "steps": {
                "checked": self.consumer.checker.checked,
                "unchecked": self.consumer.checker.unchecked,
                "queued": len(self.consumer.checker.queued),
            },
        }

    def metrics(self) -> bytes:
        led = self.consumer.ledger
        for kind in KINDS:
            self.violations.labels(kind).set(led.found[kind])
        for pool in led.names:
            self.leaked.labels(pool).set(len(led.leaked().get(pool, [])))
        self.applied.set(led.events_applied)
        self.refused.set(self.consumer.refused)
        self.steps.labels("checked").set(self.consumer.checker.checked)
        self.steps.labels("unchecked").set(self.consumer.checker.unchecked)
        return generate_latest(self.registry)


def build_app(store: StoreService, admin_api_keys: str = "") -> web.Application:
    app = web.Application(middlewares=[operator_keys(admin_api_keys)])

    async def ledger(_: web.Request) -> web.Response:
        return web.json_response(store.ledger_view())

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "ready": store.consumer.ledger.ready})

    async def session(request: web.Request) -> web.Response:
        raw = store.client.hget(store.keys.session(request.match_info["sid"]), "record")
        if raw is None:
            return web.json_response(
                {"error": {"message": "no such open session", "type": "not_found"}}, status=404
            )
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

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=store.metrics(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/ledger", ledger)
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
    await store.consume_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="custody session store service")
    Settings.add_arguments(parser)
    settings = Settings.resolve(parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s session-store %(message)s")
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1` prints every thread's stack
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
