"""The router's own error answers, shaped as the replicas shape theirs."""

from __future__ import annotations

from aiohttp import web


def error(status: int, message: str, kind: str, retry: bool = False) -> web.Response:
    """An error the router answers itself (Retry-After 1 when `retry`)."""
    headers = {"Retry-After": "1"} if retry else {}
    body = {"error": {"message": message, "type": kind}}
    return web.json_response(body, status=status, headers=headers)
