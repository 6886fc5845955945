"""The session a request names, resolved once at the edge: with API keys on, only the key
that opened a session may use it (tenancy.py scopes the name); a request a front routed
by the session's placement is refused (503, retry) unless this copy is at that placement
epoch (protocol/copies.py, `routed_to`); and the resolved `Session` then travels with
the request (budget, prompt, the engine's turn) instead of its name being looked up
again."""

from __future__ import annotations

from aiohttp import web

from protocol.copies import routed_to
from services.scheduler.http.app_keys import FRONT_DOOR
from services.scheduler.http.tenancy import session_id
from services.scheduler.records.sampling import InvalidRequest
from services.scheduler.records.session import Session, SessionError
from shared.placement import ROUTED_EPOCH_HEADER
from shared.session_ids import session_name


def own_session(request: web.Request, name: object) -> Session:
    """The caller's open session its client calls `name`, if this copy answers it."""
    session = request.app[FRONT_DOOR].session(session_id(request, name))
    epoch = routed_epoch(request)
    if not routed_to(session, epoch):
        raise SessionError(
            f"session {session_name(session.sid)} was routed by placement epoch {epoch}; "
            f"this replica holds epoch {session.epoch}: retry",
            "moving",
        )
    return session


def routed_epoch(request: web.Request) -> int | None:
    """The placement epoch a front routed `request` by (None: no front did)."""
    raw = request.headers.get(ROUTED_EPOCH_HEADER)
    if raw is None:
        return None
    if not raw.isascii() or not raw.isdigit() or len(raw) > 18:
        raise InvalidRequest(f"{ROUTED_EPOCH_HEADER} must be a placement epoch (an integer)")
    return int(raw)


def named_session(request: web.Request, name: object | None) -> Session | None:
    """The caller's session `name`, or None for a request that names none."""
    return None if name is None else own_session(request, name)
