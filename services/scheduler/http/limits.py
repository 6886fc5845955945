"""Limits that keep one client, or all of them together, from exhausting the server:
open sessions per key (`--max-sessions-per-key`) on top of the global limit that the
session manager itself keeps (`--max-sessions`), and the waiting queue
(`--max-queued-requests`). Each refusal comes before anything is allocated: a 429 for a
session (the client must close one), a 503 with Retry-After for a full queue (it drains
by itself)."""

from __future__ import annotations

import secrets

from aiohttp import web

from services.scheduler.http.app_keys import FRONT_DOOR
from services.scheduler.http.tenancy import CALLER, session_id
from services.scheduler.records.session import Session, SessionError
from shared.tenancy import Refused

RETRY_AFTER_SECONDS = 1  # a waiting request usually starts within a few steps


def open_session_within_limits(
    request: web.Request, name: str | None, timeout: float | None
) -> Session:
    """A new session of the caller, named `name` (or a random name), within the per-key
    and the global limits."""
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
        return door.open_session(session_id(request, name), timeout, tenant)
    except SessionError as err:
        if err.kind != "limit":
            raise
        raise Refused(429, str(err), "session_limit") from None


def check_queue(request: web.Request, count: int = 1) -> None:
    """503 with Retry-After when `count` more requests (OpenAI's `n` choices, a batch's
    items: each is a request) would not fit in the engine's waiting queue (0: no limit)."""
    door = request.app[FRONT_DOOR]
    limit, waiting = door.settings.max_queued_requests, door.queued
    if limit and waiting + count > limit:
        asked = "" if count == 1 else f"; this asks for {count} requests"
        raise Refused(
            503,
            f"{waiting} requests are waiting and this server queues {limit}{asked}; "
            f"retry in {RETRY_AFTER_SECONDS} s",
            "overloaded",
            {"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
