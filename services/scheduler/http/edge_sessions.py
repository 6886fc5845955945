"""The session a request names, resolved once at the edge: with API keys on, only the key
that opened a session may use it (tenancy.py scopes the name), and the resolved `Session`
then travels with the request (budget, prompt, the engine's turn) instead of its name
being looked up again."""

from __future__ import annotations

from aiohttp import web

from services.scheduler.http.app_keys import FRONT_DOOR
from services.scheduler.http.tenancy import session_id
from services.scheduler.records.session import Session


def own_session(request: web.Request, name: object) -> Session:
    """The caller's open session its client calls `name`."""
    return request.app[FRONT_DOOR].session(session_id(request, name))


def named_session(request: web.Request, name: object | None) -> Session | None:
    """The caller's session `name`, or None for a request that names none."""
    return None if name is None else own_session(request, name)
