"""Tenancy at a replica's edge: with API keys on (shared/tenancy.py), every request and
session belongs to the key that made it.

A request runs under a random 128-bit internal id, the rid the engine, the wire and the
executor see; the rid a client chose is mapped per tenant, so two keys may both use rid
"a" at once and no key can name, let alone abort, another's request. An operator key may
abort every key's requests. Session names are per key too (`session_id`).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from aiohttp import web

from services.scheduler.records.sampling import InvalidRequest
from shared.http_limits import MAX_RID
from shared.messages.cache import cache_namespace
from shared.session_ids import SESSION_ID, scoped_session_id, valid_session_name
from shared.tenancy import ANONYMOUS, ApiKeys, Caller, Refused

# what probes and Prometheus call, without a key
OPEN_PATHS = frozenset({"/health", "/health_generate", "/liveness", "/metrics"})


@dataclass(frozen=True)
class Claim:
    """One request's ids: `server` for the engine, `shown` for its client."""

    server: str
    shown: str


CALLER = web.RequestKey("caller", Caller)
CACHE_SALT = web.RequestKey("cache_salt", str)  # the body's `cache_salt`, when given
CLAIMS = web.RequestKey("claims", list)


class Tenancy(ApiKeys):
    """The replica's keys, and the rids its callers claimed."""

    def __init__(self, api_keys: str, admin_api_keys: str) -> None:
        super().__init__(api_keys, admin_api_keys)
        self._rids: dict[tuple[str | None, str], str] = {}  # (tenant, shown) -> server id

    def claim(self, request: web.Request, rid: object, prefix: str = "") -> Claim:
        """Ids for a new request of the caller: a random server id, shown as `rid` if
        the client chose one (409 while that rid runs for the same key), else as
        `prefix` + the server id. Released when the HTTP request ends (middleware)."""
        if rid is not None and rid != "" and (not isinstance(rid, str) or len(rid) > MAX_RID):
            raise InvalidRequest(f"rid must be a string of at most {MAX_RID} characters")
        server = secrets.token_hex(16)
        shown = rid or f"{prefix}{server}"
        key = self.hold(request[CALLER].tenant, shown, server)
        request.setdefault(CLAIMS, []).append(key)
        return Claim(server, shown)

    def hold(self, tenant: str | None, shown: str, server: str) -> tuple[str | None, str]:
        """Record that `tenant`'s request `shown` runs as `server` (409 while that rid
        runs for the same key): what a claim, and an edge worker's call in the core
        (edge/core_side.py), hold until `drop`."""
        key = (tenant, shown)
        if key in self._rids:
            raise Refused(
                409, f"rid {shown!r} is already in use by a request of yours", "rid_in_use"
            )
        self._rids[key] = server
        return key

    def drop(self, keys: Iterable[tuple[str | None, str]]) -> None:
        for key in keys:
            self._rids.pop(key, None)

    def release(self, request: web.Request) -> None:
        self.drop(request.get(CLAIMS, ()))

    def abort_targets(
        self, request: web.Request, rid: object, abort_all: bool, running: Iterable[str]
    ) -> list[str]:
        """Server ids to abort: by `rid`, the caller's own request of that rid; with
        `abort_all`, the caller's own requests, or every request (`running`) for an
        operator."""
        caller = request[CALLER]
        if abort_all:
            if caller.operator:
                return list(running)
            return [s for (tenant, _), s in self._rids.items() if tenant == caller.tenant]
        found = self._rids.get((caller.tenant, rid)) if isinstance(rid, str) else None
        return [] if found is None else [found]


def session_id(request: web.Request, name: object) -> str:
    """The id of the caller's session `name` (shared/session_ids.py): with keys on, a
    key sees only its own sessions, so any other key's miss is the same 404."""
    if not valid_session_name(name):
        raise InvalidRequest(f"session_id must match {SESSION_ID.pattern}")
    return scoped_session_id(request[CALLER].tenant, name)


def tenant_of(request: web.Request) -> str | None:
    """The key the request runs for (None: keys off, or an open path)."""
    return request.get(CALLER, ANONYMOUS).tenant


def cache_namespace_of(request: web.Request) -> str:
    """The prefix cache the caller's requests may match and feed (shared/messages/cache.py)."""
    return cache_namespace(tenant_of(request), request.get(CACHE_SALT))


def middleware(tenancy: Tenancy):
    """Identify the caller before the handler runs (a refusal is answered by errors.py,
    as every other), and free the request's rids when it ends."""

    @web.middleware
    async def guard(request: web.Request, handler) -> web.StreamResponse:
        try:
            if request.path not in OPEN_PATHS:
                request[CALLER] = tenancy.identify(request)
            return await handler(request)
        finally:
            tenancy.release(request)

    return guard
