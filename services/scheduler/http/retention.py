"""Retention hints (docs/tiers.md "Retention hints"): a turn's `cache_control`, shaped as
Anthropic's (`{"type": "ephemeral", "ttl": "5m" | "1h"}`), with a priority, asks that its
session's state stay in the faster tiers while an agent waits on a tool. On the Messages
API it is Anthropic's own field; on the Responses and chat completions APIs an extension
field, beside `retention_priority`. The tier policy orders its victims by it
(sessions/tier_policy.py); nothing is reserved, so a hint can never refuse a request."""

from __future__ import annotations

from aiohttp import web

from services.scheduler.http.app_keys import FRONT_DOOR
from services.scheduler.http.schema_types import TTL_SECONDS, CacheControl
from services.scheduler.records.session import Session


def hint(
    request: web.Request,
    session: Session | None,
    cache_control: CacheControl | None,
    priority: int | None,
) -> None:
    """Give `session` the turn's hint (none without `cache_control`; a stateless turn
    has no session to hint)."""
    if session is None or cache_control is None:
        return
    door = request.app[FRONT_DOOR]
    door.retain(session, TTL_SECONDS[cache_control.ttl], priority or 0, cache_control.ttl)
