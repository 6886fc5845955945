"""The operator routes the router moves a session between replicas with (draining a
replica, re-homing the sessions of a dead one): SessionManager's moves between
replicas have the why."""

from __future__ import annotations

import msgspec
from aiohttp import web

from services.scheduler.http.app_keys import FRONT_DOOR, SCHEMAS
from services.scheduler.http.bodies import read_body
from services.scheduler.http.replies import Placed
from services.scheduler.records.sampling import InvalidRequest
from services.scheduler.records.session import Session


def _placed(sid: str, session: Session | None) -> web.Response:
    """Where `session`'s state is now; a lost session (None) has none."""
    placed = (
        Placed(sid, None, 0)
        if session is None
        else Placed(sid, session.state_tier, session.cached_len)
    )
    return web.json_response(msgspec.to_builtins(placed))


async def migrate_out(request: web.Request) -> web.Response:
    body = await read_body(request, request.app[SCHEMAS].migrate)
    return _placed(body.session_id, await request.app[FRONT_DOOR].migrate_out(body.session_id))


async def migrate_in(request: web.Request) -> web.Response:
    body = await read_body(request, request.app[SCHEMAS].migrate)
    if body.source is None or body.epoch is None:
        raise InvalidRequest(
            "source and epoch (the move's source replica, its new epoch) are required"
        )
    door = request.app[FRONT_DOOR]
    session = await door.migrate_in(body.session_id, body.source, body.epoch, body.move)
    return _placed(body.session_id, session)  # None: it arrived lost (`session_lost` here)


async def migrate_done(request: web.Request) -> web.Response:
    body = await read_body(request, request.app[SCHEMAS].migrate)
    await request.app[FRONT_DOOR].migrate_done(body.session_id)
    return web.json_response(True)


async def migrate_cancel(request: web.Request) -> web.Response:
    body = await read_body(request, request.app[SCHEMAS].migrate)
    await request.app[FRONT_DOOR].migrate_cancel(body.session_id)
    return web.json_response(True)


ROUTES = (
    ("POST", "/admin/migrate_out", migrate_out),
    ("POST", "/admin/migrate_in", migrate_in),
    ("POST", "/admin/migrate_done", migrate_done),
    ("POST", "/admin/migrate_cancel", migrate_cancel),
)
