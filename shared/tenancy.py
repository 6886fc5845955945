"""API keys, as both HTTP edges check them: the router and every replica identify a
caller the same way, so a key the router lets through is one its replica accepts.

A caller is known by the sha256 of its key (its tenant), never by the key itself: that
hash is what a session's durable record keeps, so after a restart a session's owner
still has it and every other key still gets 404. An operator key (`--admin-api-keys`,
valid as a normal key too) is required for the operator routes. With no key configured,
everyone is one anonymous operator, as before tenancy.

Keys are compared in constant time, as digests, against every configured key, and are
never logged.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from aiohttp import web

OPERATOR_PATHS = frozenset(
    {
        "/flush_cache",
        "/reset_prefix_cache",
        "/place_session",
        "/admin/migrate_out",
        "/admin/migrate_in",
        "/admin/migrate_done",
        "/admin/migrate_cancel",
        "/admin/idle_sessions",
    }
)


@dataclass(frozen=True)
class Caller:
    tenant: str | None  # sha256 hex of its key; None when keys are off
    operator: bool


ANONYMOUS = Caller(None, operator=True)


class Refused(Exception):
    """A refusal with its status and headers (Retry-After), answered as
    `{"error": {"message", "type"}}`."""

    def __init__(
        self, status: int, message: str, kind: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.headers = status, kind, headers or {}


class ApiKeys:
    def __init__(self, api_keys: str, admin_api_keys: str) -> None:
        admin = _split(admin_api_keys)
        self._keys = [(_digest(k), k in admin) for k in sorted(_split(api_keys) | admin)]

    def identify(self, request: web.Request) -> Caller:
        """The caller of `request`; 401 without a valid key, 403 on an operator route
        without an operator key."""
        return self.caller(authorization(request.headers), request.path)

    def caller(self, authorization: str, path: str) -> Caller:
        """`identify` from an `Authorization` header's value and the path asked for: a
        front that is not an HTTP server (the endpoint picker) reads them from its own
        protocol."""
        if not self._keys:
            return ANONYMOUS
        scheme, _, key = authorization.partition(" ")
        presented = _digest(key.strip()) if scheme.lower() == "bearer" else b""
        caller = None
        for digest, operator in self._keys:  # no early exit: every key is compared
            if hmac.compare_digest(digest, presented) and caller is None:
                caller = Caller(digest.hex(), operator)
        if caller is None:
            raise Refused(
                401,
                "a valid API key is required (Authorization: Bearer ..., or x-api-key)",
                "authentication_error",
            )
        if path in OPERATOR_PATHS and not caller.operator:
            raise Refused(403, f"{path} needs an operator key", "permission_error")
        return caller


def authorization(headers: Mapping[str, str]) -> str:
    """The `Authorization` header's value, or an `x-api-key` header's key (the header
    Anthropic's clients send) as the bearer key it is when that is absent; `headers`
    case-insensitive, or with lowercase names."""
    value = headers.get("authorization")
    if value is not None:
        return value
    key = headers.get("x-api-key")
    return "" if key is None else f"Bearer {key}"


def _split(keys: str) -> set[str]:
    return {k.strip() for k in keys.split(",") if k.strip()}


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
