"""Forwarding one HTTP request to a replica and its answer back, streaming server-sent
events chunk by chunk as they arrive. A client that goes away closes the upstream
connection, which the replica takes as an abort of the request."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from fronts.replicas import Replica
from services.router.metrics import RouterMetrics

PASSED_UP = ("Authorization", "X-Api-Key", "Content-Type", "Accept")  # a key either way
WARM_CONNECTIONS = 8  # opened to each replica before it is ready (a burst's first requests)
WARM_SECONDS = 2.0  # a replica that does not answer is not waited for longer (nor routed less)
PASSED_DOWN = ("Content-Type", "Retry-After", "Cache-Control")
# (seconds from receipt to the upstream send, when the whole upstream answer was in) of a
# request answered in one piece: its overhead ends when the router starts its answer
UPSTREAM_TIMES = web.RequestKey("upstream_times", tuple)
KIND = web.RequestKey("kind", str)  # the request's kind for the overhead histogram
# the pick's own headers for the replica (fronts/decision.py, `Pick.upstream_headers`)
PICK_HEADERS = web.RequestKey("pick_headers", dict)
# the replica's answer's headers, lowercased (a pick's bookkeeping reads an open's number)
UPSTREAM_HEADERS = web.RequestKey("upstream_headers", dict)


class ReplicaDown(Exception):
    """The replica could not be reached; nothing was sent to it."""


class OutcomeUnknown(Exception):
    """The request went to the replica, and the connection broke before its whole answer
    came back: it may have run (a turn may be in the session's history). Never retried
    elsewhere, never answered with a retryable status."""


class Proxy:
    def __init__(self, metrics: RouterMetrics, session_header: str = "") -> None:
        """`session_header`: passed up too, so the replica binds the same session."""
        self.metrics = metrics
        self.passed_up = (*PASSED_UP, session_header) if session_header else PASSED_UP
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            auto_decompress=False,
        )

    async def warm(self, replica: Replica) -> None:
        """Open `WARM_CONNECTIONS` keep-alive connections to `replica` (concurrent
        liveness probes), replacing any that a previous life of it left dead. Bounded: a
        replica that hangs must not stall the registration reads that wait for this."""

        async def probe() -> None:
            try:
                async with self.session.get(
                    replica.url + "/liveness", timeout=aiohttp.ClientTimeout(total=WARM_SECONDS)
                ) as answer:
                    await answer.read()
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass  # a dead connection dropped; the next request opens another

        await asyncio.gather(*(probe() for _ in range(WARM_CONNECTIONS)))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def forward(
        self,
        request: web.Request,
        replica: Replica,
        body: bytes,
        received: float,
        unless: frozenset[int] = frozenset(),
    ) -> web.StreamResponse | None:
        """`request` (its `body` already read) answered by `replica`; None, with the
        answer dropped, if its status is in `unless`. Raises `ReplicaDown` if the replica
        cannot be connected to."""
        headers = {h: request.headers[h] for h in self.passed_up if h in request.headers}
        headers.update(request.get(PICK_HEADERS, {}))
        replica.in_flight += 1
        try:
            sent = time.perf_counter()
            try:
                upstream = await self.session.request(
                    request.method, replica.url + request.path_qs, data=body, headers=headers
                )
                async with upstream:
                    request[UPSTREAM_HEADERS] = {k.lower(): v for k, v in upstream.headers.items()}
                    if upstream.status in unless:
                        await upstream.read()
                        return None
                    return await self._answer(request, upstream, sent - received)
            except aiohttp.ClientConnectorError as err:
                self.metrics.upstream_errors.labels(replica.id).inc()
                raise ReplicaDown(f"replica {replica.id} unreachable: {err}") from err
            except (aiohttp.ClientError, OSError) as err:
                if request.transport is None or request.transport.is_closing():
                    raise  # the client left: its answer has nowhere to go
                self.metrics.upstream_errors.labels(replica.id).inc()
                raise OutcomeUnknown(
                    f"replica {replica.id} dropped the request before answering it whole "
                    f"({type(err).__name__}); it may have run"
                ) from err
        finally:
            replica.in_flight -= 1

    async def call(self, request: web.Request, replica: Replica, body: bytes) -> web.Response:
        """`request` answered by `replica`, read whole (a fan-out's part); a replica that
        cannot be reached is a 503."""
        headers = {h: request.headers[h] for h in PASSED_UP if h in request.headers}
        url = replica.url + request.path_qs
        try:
            async with self.session.request(
                request.method, url, data=body, headers=headers
            ) as upstream:
                answer = await upstream.read()
                kept = {h: upstream.headers[h] for h in PASSED_DOWN if h in upstream.headers}
                return web.Response(status=upstream.status, body=answer, headers=kept)
        except (aiohttp.ClientConnectionError, OSError) as err:
            self.metrics.upstream_errors.labels(replica.id).inc()
            message = f"replica {replica.id} unreachable: {err}"
            return web.json_response(
                {"error": {"message": message, "type": "replica_unavailable"}}, status=503
            )

    async def _answer(
        self, request: web.Request, upstream: aiohttp.ClientResponse, before: float
    ) -> web.StreamResponse:
        first = time.perf_counter()
        headers = {h: upstream.headers[h] for h in PASSED_DOWN if h in upstream.headers}
        if upstream.content_type != "text/event-stream":
            body = await upstream.read()
            request[UPSTREAM_TIMES] = (before, time.perf_counter())  # the router observes
            return web.Response(status=upstream.status, body=body, headers=headers)
        response = web.StreamResponse(status=upstream.status, headers=headers)
        await response.prepare(request)
        overhead = before + time.perf_counter() - first
        self.metrics.overhead.labels(request.get(KIND, "other")).observe(overhead)
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except (aiohttp.ClientError, OSError):
            # the replica went mid-stream: the client's stream ends without its last
            # event, as the replica's own would have (the status is already sent)
            if request.transport is not None:
                request.transport.close()
            return response
        await response.write_eof()
        return response
