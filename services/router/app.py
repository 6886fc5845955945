"""The router's HTTP edge: the whole public API of a replica, each request sent to the
replica that should answer it.

- A session's turns (`/generate` with `session_params.id`, chat with `session_id`,
  `/close_session`, `/place_session`) go where the directory places the session
  (`affinity`); an open is placed on the least loaded replica while that replica opens it.
- Anything else goes to the ready replica with the longest cached prefix of its prompt
  within a bounded load (`prefix`), else the least loaded (`load`), choice.py; a body
  the router cannot read goes by load, and that replica answers it with its own 400.
- `/abort_request` by rid goes where that rid was sent; `abort_all`, an unknown rid and
  `/flush_cache` and `/reset_prefix_cache` go to every ready replica (`fanout`).

API keys are checked here as each replica checks them (the same `ApiKeys`,
shared/tenancy.py), and passed on, so a replica still knows the caller. A session placed
on a replica that is not live is answered 503 with Retry-After: its state is there, and
the turn waits for it; so is a session in transit between replicas (shared/placement.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time

from aiohttp import web
from redis.exceptions import RedisError

from services.router.errors import error
from services.router.proxy import (
    KIND,
    OPENED,
    PLACING,
    UPSTREAM_TIMES,
    OutcomeUnknown,
    Proxy,
    ReplicaDown,
)
from shared.http_limits import MAX_BATCH, MAX_BODY, MAX_RID
from shared.placement import Placement
from shared.retry import DEPENDENCY_FAULTS
from shared.routing.addressing import (
    FANOUT_ROUTES,
    RepeatedHeader,
    aborts_all,
    header_session,
    read_json,
    session_of,
)
from shared.routing.background import Background
from shared.routing.front import Routing
from shared.routing.replicas import Opening, Replica
from shared.session_ids import SESSION_ID, scoped_session_id, session_name, valid_session_name
from shared.tenancy import Refused

log = logging.getLogger("custody.router")
STALE = frozenset({404, 503})  # a replica's answers for a session it does not hold now


class Router:
    def __init__(self, routing: Routing, proxy: Proxy, session_header: str = "") -> None:
        """`session_header`: the header naming a chat request's implicit session
        (services/scheduler/http/header_sessions.py), as the replicas are told."""
        self.limits, self.session_header = routing.limits, session_header
        self.table, self.directory, self.proxy = routing.table, routing.directory, proxy
        self.tenancy, self.chooser, self.mover = routing.tenancy, routing.chooser, routing.mover
        self.metrics = proxy.metrics
        self.background = Background(self.metrics.faults)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """The request routed and answered. A streamed answer's overhead is observed as
        its first byte goes (proxy.py); one in one piece, here, once the router starts
        sending it: so what the router does after the upstream answered counts too. Redis
        unreachable is a 503 (the directory cannot be read), not a failure."""
        try:
            response = await self.route(request)
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
        received = time.perf_counter()
        if request.path == "/metrics":
            return web.Response(body=self.metrics.render(), content_type="text/plain")
        if request.path == "/health":
            return self.health(request)
        if request.path == "/liveness":
            return web.json_response({"status": "alive"})
        if request.path == "/health_generate":  # a probe: no key, any ready replica
            replica = self.table.least_loaded()
            if replica is None:
                return self.health(request)
            return await self.send(request, b"", replica, "load", received)
        try:
            caller = self.tenancy.identify(request)
        except Refused as refused:
            return refused.response()
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            message = f"the body is larger than {MAX_BODY} bytes"
            return error(413, message, "request_too_large")
        parsed = read_json(body)
        tenant = caller.tenant or "-"
        if request.path in FANOUT_ROUTES or aborts_all(request.path, parsed):
            return await self.fan_out(request, body)
        if request.path == "/abort_request":
            rid = parsed.get("rid") if parsed else None
            home = await self.directory.request(tenant, rid) if isinstance(rid, str) else None
            if home is None:
                return await self.fan_out(request, body)
            return await self.to_placed(request, body, home, "request", received)
        if request.path == "/open_session":
            request[KIND] = "open"
            return await self.open_session(request, caller.tenant, parsed, body, received)
        if request.path == "/admin/drain":
            return await self.drain(caller.operator, parsed)
        try:
            implied = header_session(
                request.path, parsed, request.headers, self.session_header, caller.tenant
            )
        except RepeatedHeader as err:
            return error(400, str(err), "invalid_request_error")
        implicit = implied is not None  # never with a session in the body
        sid = implied if implicit else session_of(request.path, parsed, caller.tenant)
        if sid is not None:
            request[KIND] = "turn"
            await self.mover.settled(sid)
            response = await self.to_seen(request, body, sid, received)
            if response is None:
                response = await self.to_session(request, body, sid, received)
            if response is None and implicit:
                response = await self.place_implicit(request, caller.tenant, body, sid, received)
            if response is not None:
                return response
        choice = self.chooser.pick(request.path, parsed, caller.tenant)
        if choice is None:
            return error(503, "no replica is ready", "no_replica", retry=True)
        if request.path == "/generate" and parsed is not None:
            self._remember_rids(tenant, parsed.get("rid"), choice.replica.id)
        return await self.send(request, body, choice.replica, choice.decision, received)

    async def place_implicit(
        self,
        request: web.Request,
        tenant: str | None,
        body: bytes,
        sid: str,
        received: float,
    ) -> web.StreamResponse | None:
        """The first turn of a session the header names, placed before it is sent (its
        replica opens the session as it runs the turn): the directory, not this router,
        decides where later turns go, so no two replicas ever hold it. None: no replica
        is ready (the request is routed as any other)."""
        replica = self.table.least_loaded()
        if replica is None:
            return None
        refused = self.limits.refuse_open(tenant)
        if refused is not None:
            return error(429, refused, "session_limit")
        home, _ = await self.directory.place(sid, replica.id)
        request[PLACING] = home.replica == replica.id
        return await self.to_placed(request, body, home.replica, "affinity", received)

    async def to_seen(
        self, request: web.Request, body: bytes, sid: str, received: float
    ) -> web.StreamResponse | None:
        """Sent where this router last saw the session placed, without reading Redis; None
        if it saw nothing, that replica is not ready, or it answered that the session is
        not there (404: moved or closed by another router) or not now (503)."""
        home = self.directory.seen(sid)
        replica = None if home is None or home.moving_to else self.table.live.get(home.replica)
        if replica is None or not replica.executor:
            return None
        response = await self.send(request, body, replica, "affinity", received, STALE)
        if response is not None and request.path == "/close_session" and response.status == 200:
            self.background.run(lambda: self.directory.forget(sid, home.replica))
        return response

    async def to_session(
        self, request: web.Request, body: bytes, sid: str, received: float
    ) -> web.StreamResponse | None:
        """Sent where the directory places the session; None if it places it nowhere."""
        home = await self.directory.session(sid)
        if home is not None and home.moving_to is not None:
            message = f"session {session_name(sid)} is moving to replica {home.moving_to}; retry"
            return error(503, message, "moving", retry=True)
        if home is None:
            return None
        response = await self.to_placed(request, body, home.replica, "affinity", received)
        if request.path == "/close_session" and response.status == 200:
            self.background.run(lambda: self.directory.forget(sid, home.replica))
        return response

    async def open_session(
        self,
        request: web.Request,
        tenant: str | None,
        parsed: dict | None,
        body: bytes,
        received: float,
    ) -> web.StreamResponse:
        """Place and open at once (the router names the session when the client did not):
        the open is sent to the replica the placement is written for, which it names
        unless another open of the same id placed it first; then the copy opened here is
        released and the open sent where that one placed it. An open the replica refuses
        leaves no placement behind."""
        replica = self.table.least_loaded()
        if parsed is None or replica is None:
            if replica is None:
                return error(503, "no replica is ready", "no_replica", retry=True)
            return await self.send(request, body, replica, "load", received)
        name = parsed.get("session_id")
        if name is None:
            name = parsed["session_id"] = secrets.token_hex(16)
            body = json.dumps(parsed).encode()
        if not isinstance(name, str):
            return await self.send(request, body, replica, "load", received)
        if not valid_session_name(name):  # refused before it can name a Redis key
            return error(400, f"session_id must match {SESSION_ID.pattern}", "session_invalid")
        sid = scoped_session_id(tenant, name)
        refused = self.limits.refuse_open(tenant)
        if refused is not None:
            return error(429, refused, "session_limit")
        opening = Opening(tenant)  # counted while it runs, then (below) until the
        replica.placed.append(opening)  # registrations read count it (shared/routing/replicas.py)
        try:
            response = await self._open(request, body, sid, replica, received)
        finally:
            replica.placed.remove(opening)
        if response.status == 200:
            home, mark = request.get(OPENED, (replica, None))  # the replica that opened it
            home.answered(Opening(tenant, time.monotonic(), mark))
        return response

    async def _open(
        self, request: web.Request, body: bytes, sid: str, replica: Replica, received: float
    ) -> web.StreamResponse:
        placing = asyncio.ensure_future(self.directory.place(sid, replica.id))
        request[PLACING] = True
        try:
            response = await self.send(request, body, replica, "affinity", received)
            home, placed = await placing
        except BaseException:  # Redis failed, or the client left: nothing stays behind
            self.background.run(lambda: self._abandon(placing, replica, sid))
            raise
        if home.replica != replica.id:
            if response.status == 200:
                self.background.run(lambda: self.mover.release(replica, sid))
            response = await self.to_placed(request, body, home.replica, "affinity", received)
        if placed and response.status != 200:
            self.background.run(lambda: self.directory.forget(sid, home.replica))
        return response

    async def _abandon(self, placing: asyncio.Future, replica: Replica, sid: str) -> None:
        """An open that failed part-way: its placement, if written, and then the copy
        opened on `replica`, if any, go. A placement write that failed may have been
        applied: the placement goes if it is this open's (a compare-and-delete)."""
        try:
            home, placed = await placing
        except DEPENDENCY_FAULTS:
            await self.directory.take_back(sid, Placement(replica.id))
        else:
            if placed:
                await self.directory.forget(sid, home.replica)
        await self.mover.release(replica, sid)

    async def drain(self, operator: bool, body: dict | None) -> web.Response:
        """Move every session off a replica, which takes nothing new from then on."""
        if not operator:
            return error(403, "/admin/drain needs an operator key", "permission_error")
        replica = body.get("replica") if body else None
        if not isinstance(replica, str) or replica not in self.table.known:
            return error(404, f"no replica {replica!r}", "not_found")
        return web.json_response(await self.mover.drain(replica))

    async def to_placed(
        self, request: web.Request, body: bytes, home: str, decision: str, received: float
    ) -> web.StreamResponse:
        replica = self.table.live.get(home)
        if replica is None or not replica.executor:
            return error(
                503, f"replica {home} is not available; retry", "replica_unavailable", True
            )
        return await self.send(request, body, replica, decision, received)

    async def send(
        self,
        request: web.Request,
        body: bytes,
        replica: Replica,
        decision: str,
        received: float,
        unless: frozenset[int] = frozenset(),
    ) -> web.StreamResponse | None:
        """The replica's answer; None if its status is in `unless` (or, with `unless`,
        the replica could not be reached), for the caller to send it elsewhere."""
        self.metrics.routed.labels(decision, replica.id).inc()
        try:
            return await self.proxy.forward(request, replica, body, received, unless)
        except ReplicaDown as down:
            if unless:
                return None
            return error(503, str(down), "replica_unavailable", retry=True)
        except OutcomeUnknown as unknown:
            return error(502, str(unknown), "outcome_unknown")

    async def fan_out(self, request: web.Request, body: bytes) -> web.Response:
        """The same request to every ready replica; the first refusal if any refused,
        else the first answer."""
        ready = self.table.ready()
        if not ready:
            return error(503, "no replica is ready", "no_replica", retry=True)
        for replica in ready:
            self.metrics.routed.labels("fanout", replica.id).inc()
        answers = await asyncio.gather(
            *(self.proxy.call(request, replica, body) for replica in ready)
        )
        refused = [a for a in answers if a.status != 200]
        return (refused or answers)[0]

    def _remember_rids(self, tenant: str, rid: object, replica: str) -> None:
        """Kept while the request runs (an abort by a rid not yet kept goes to every
        replica, so it still finds it), in one Redis round trip. A rid the replica will
        refuse (a list longer than a batch, an id empty or too long) is not kept: the
        work a request costs the router is bounded before it is looked at."""
        rids = rid if isinstance(rid, list) else [rid]
        if len(rids) > MAX_BATCH or not all(
            isinstance(one, str) and 0 < len(one) <= MAX_RID for one in rids
        ):
            return
        self.background.run(lambda: self.directory.remember_requests(tenant, rids, replica))

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
