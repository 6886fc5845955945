"""The router's HTTP edge: the whole public API of a replica, each request sent where the
one routing decision of the fronts (fronts/decision.py) says, through the proxy
(proxy.py): a session's requests where the directory places it, an open placed on the
least loaded replica, anything else by prefix within a bounded load. What that decision
cannot give one replica, the router does itself: `/flush_cache`, `/reset_prefix_cache`,
an `abort_all` and an abort by a rid no front kept go to every ready replica (`fanout`).

A pick made from the placements this router remembers may meet a replica that no longer
holds the session (a change still on its way): it answers 404 or 503, and the router
picks again from the directory. API keys are checked by the decision as each replica
checks them (shared/tenancy.py), and passed on, so a replica still knows the caller.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from aiohttp import web
from redis.exceptions import RedisError

from fronts.addressing import FANOUT_ROUTES
from fronts.decision import Decision, FanOut, Pick, Refusal
from fronts.replicas import ReplicaTable
from services.router.errors import error
from services.router.proxy import (
    KIND,
    PICK_HEADERS,
    UPSTREAM_HEADERS,
    UPSTREAM_TIMES,
    OutcomeUnknown,
    Proxy,
    ReplicaDown,
)
from shared.http_limits import MAX_BODY
from shared.tenancy import ApiKeys, Refused

log = logging.getLogger("custody.router")
STALE = frozenset({404, 503})  # a replica's answers for a session it does not hold now
KEPT = ("kv_pages_kept", "mamba_slots_kept")  # what a replica's flush could not evict


def kept_by_all(answers: list[web.Response]) -> web.Response:
    """One flush answer for the fleet, its kept counts summed over the replicas: a caller
    that needs cold caches must hear of pages kept anywhere, not only on the first."""
    replies = [json.loads(a.body) for a in answers]
    return web.json_response(replies[0] | {k: sum(r[k] for r in replies) for k in KEPT})


class Router:
    def __init__(
        self, decision: Decision, table: ReplicaTable, tenancy: ApiKeys, proxy: Proxy
    ) -> None:
        self.decision, self.table, self.tenancy, self.proxy = decision, table, tenancy, proxy
        self.metrics = proxy.metrics

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """The request routed and answered. A streamed answer's overhead is observed as
        its first byte goes (proxy.py); one in one piece, here, once the router starts
        sending it: so what the router does after the upstream answered counts too. Redis
        unreachable is a 503 (the directory cannot be read), not a failure."""
        try:
            response = await self.route(request)
        except Refusal as refusal:
            response = web.Response(
                status=refusal.status,
                body=refusal.body(),
                headers=refusal.headers,
                content_type="application/json",
            )
        except (RedisError, ConnectionError) as err:
            log.warning("%s: Redis unavailable (%s)", request.path, err)
            message = "the placement directory (Redis) is unavailable; retry"
            return error(503, message, "directory_unavailable", retry=True)
        times = request.get(UPSTREAM_TIMES)
        if times is not None and not response.prepared:
            await response.prepare(request)
            before, first = times
            overhead = before + time.perf_counter() - first
            self.metrics.overhead.labels(request.get(KIND, "other")).observe(overhead)
        return response

    async def route(self, request: web.Request) -> web.StreamResponse:
        """Raises `Refusal` (the decision's own answer)."""
        received = time.perf_counter()
        if request.path == "/metrics":
            return web.Response(body=self.metrics.render(), content_type="text/plain")
        if request.path == "/health":
            return self.health(request)
        if request.path == "/liveness":
            return web.json_response({"status": "alive"})
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            message = f"the body is larger than {MAX_BODY} bytes"
            return error(413, message, "request_too_large")
        if request.path == "/admin/drain":
            return web.json_response(await self.decision.drain(request.headers, body))
        try:
            pick = await self.decision.pick(request.path, request.headers, body)
        except FanOut:
            return await self.fan_out(request, body)
        request[KIND] = pick.kind
        response = await self.send(request, body, pick, received)
        if response is None:  # the placement remembered was stale: read it
            pick = await self.decision.pick(request.path, request.headers, body, fresh=True)
            response = await self.send(request, body, pick, received)
        return response

    async def send(
        self, request: web.Request, body: bytes, pick: Pick, received: float
    ) -> web.StreamResponse | None:
        """The picked replica's answer, its bookkeeping done (`Pick.done`); None when the
        pick was remembered and the replica answered that it does not hold the session
        (or could not be reached), for the caller to pick again."""
        unless = STALE if pick.remembered else frozenset()
        request[PICK_HEADERS] = pick.upstream_headers()
        self.metrics.routed.labels(pick.decision, pick.replica.id).inc()
        sent = body if pick.body is None else pick.body
        try:
            response = await self.proxy.forward(request, pick.replica, sent, received, unless)
        except ReplicaDown as down:
            pick.done(503, {})  # nothing was sent
            if unless:
                return None
            return error(503, str(down), "replica_unavailable", retry=True)
        except OutcomeUnknown as unknown:
            pick.done(None, {})
            return error(502, str(unknown), "outcome_unknown")
        except BaseException:  # the client left: the answer never came back whole
            pick.done(None, {})
            raise
        if response is not None:
            pick.done(response.status, request.get(UPSTREAM_HEADERS, {}))
        return response

    async def fan_out(self, request: web.Request, body: bytes) -> web.Response:
        """The same request to every ready replica; the first refusal if any refused,
        else one answer: a flush's adds up what every replica kept, any other's is the
        first."""
        ready = self.table.ready()
        if not ready:
            return error(503, "no replica is ready", "no_replica", retry=True)
        for replica in ready:
            self.metrics.routed.labels("fanout", replica.id).inc()
        answers = await asyncio.gather(
            *(self.proxy.call(request, replica, body) for replica in ready)
        )
        refused = [a for a in answers if a.status != 200]
        if refused:
            return refused[0]
        return kept_by_all(answers) if request.path in FANOUT_ROUTES else answers[0]

    def health(self, request: web.Request) -> web.Response:
        """Ready (200) with at least one ready replica, else 503 with Retry-After: a
        router with none would answer every request 503. Replica addresses are shown to
        an operator only (they are the cluster's inside)."""
        try:
            operator = self.tenancy.identify(request).operator
        except Refused:
            operator = False
        replicas = {
            r.id: {"executor": r.executor, "load": r.load} | ({"url": r.url} if operator else {})
            for r in self.table.live.values()
        }
        ready = len(self.table.ready())
        body = {"status": "ok" if ready else "starting", "executor": ready > 0, "ready": ready}
        if not ready:
            body["waiting_for"] = ["replica"]
        return web.json_response(
            body | {"replicas": replicas},
            status=200 if ready else 503,
            headers={} if ready else {"Retry-After": "1"},
        )
