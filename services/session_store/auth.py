"""Operator keys for the session store's HTTP: with `admin_api_keys` set, every route but
`/health` and `/metrics` (what orchestrators and Prometheus scrape) needs
`Authorization: Bearer <key>`. The ledger and the session records name sessions and
their histories, so they are for operators only. Keys are compared in constant time
against every configured key, and never logged."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

OPEN_PATHS = frozenset({"/health", "/metrics"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def operator_keys(keys: str) -> Callable:
    """Middleware refusing operator routes without a valid key; open when `keys` is empty."""
    allowed = [k.strip().encode() for k in keys.split(",") if k.strip()]

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if allowed and request.path not in OPEN_PATHS and not _valid(request, allowed):
            return web.json_response(
                {
                    "error": {
                        "message": "an operator key is required (Authorization: Bearer ...)",
                        "type": "authentication_error",
                    }
                },
                status=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    return check


def _valid(request: web.Request, allowed: list[bytes]) -> bool:
    auth = request.headers.get("Authorization", "")
    given = auth.removeprefix("Bearer ").encode("utf-8", "replace")
    matched = False
    for key in allowed:  # every key, so the time taken says nothing about which matched
        matched |= hmac.compare_digest(given, key)
    return auth.startswith("Bearer ") and matched
