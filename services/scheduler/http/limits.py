"""Limits that keep one client, or all of them together, from exhausting the server:
open sessions per key (`--max-sessions-per-key`) on top of the global limit that the
session manager itself keeps (`--max-sessions`). Each refusal comes before anything is
allocated: a 429 (the client must close one). The waiting queue's limit is the core's
(FrontDoor.follow), as every edge worker's requests share that queue."""

from __future__ import annotations

import secrets

from aiohttp import web

from services.scheduler.http.app_keys import FRONT_DOOR
from services.scheduler.http.tenancy import CALLER, session_id
from services.scheduler.records.session import Session, SessionError
from shared.tenancy import Refused


def open_session_within_limits(
    request: web.Request, name: str | None, timeout: float | None, streaming: bool = False
) -> Session:
    """A new session of the caller, named `name` (or a random name), within the per-key
    and the global limits; append-only if `streaming`."""
    tenant, door = request[CALLER].tenant, request.app[FRONT_DOOR]
    per_key = door.settings.max_sessions_per_key
    if tenant is not None and per_key:
        held = door.sessions_of(tenant)
        if held >= per_key:
            raise Refused(
                429,
                f"this API key has {held} sessions open, its limit "
                "(--max-sessions-per-key); close one first",
                "session_limit",
            )
    name = secrets.token_hex(16) if name is None else name
    try:
        return door.open_session(session_id(request, name), timeout, tenant, streaming)
    except SessionError as err:
        if err.kind != "limit":
            raise
        raise Refused(429, str(err), "session_limit") from None
