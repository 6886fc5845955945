"""Operator keys for the session store's HTTP: with `admin_api_keys` set, every route but
`/health` and `/metrics` (what orchestrators and Prometheus scrape) needs
`Authorization: Bearer <key>`. The ledger and the session records name sessions and
their histories, so they are for operators only."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from shared.tenancy import ApiKeys, Refused

OPEN_PATHS = frozenset({"/health", "/metrics"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def operator_keys(keys: str) -> Callable:
    """Middleware refusing operator routes without a valid key; open when `keys` is empty.
    Every key given is an operator's (shared/tenancy.py compares them)."""
    operators = ApiKeys("", keys)

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            try:
                operators.identify(request)
            except Refused:
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
