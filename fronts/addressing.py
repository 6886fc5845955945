"""What a request addresses (a session, every replica), read from its path, body and
session header before anything is sent: by the router as by the endpoint picker, so both
send a session's turns to the same replica. The header is read as the replica reads it
(shared/session_header.py), so all three refuse a repeated one alike."""

from __future__ import annotations

import json

from multidict import MultiMapping

from shared.session_header import read_session_header
from shared.session_ids import (
    response_session,
    scoped_session_id,
    valid_session_id,
    valid_session_name,
)

HEADER_ROUTES = frozenset({"/v1/chat/completions", "/v1/messages"})  # bound by the header
RESPONSES = "/v1/responses/"  # a stored response's routes: the id follows
SESSION_ROUTES = frozenset({"/close_session", "/place_session", "/fork_session"})
FANOUT_ROUTES = frozenset({"/flush_cache", "/reset_prefix_cache"})


def read_json(body: bytes) -> dict | None:
    """The body as a JSON object, or None (the replica answers it with its own 400)."""
    try:
        value = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError, RecursionError):  # nested too deep: refused there
        return None
    return value if isinstance(value, dict) else None


def session_of(path: str, body: dict | None, tenant: str | None) -> str | None:
    """The id of the session a request of `tenant` addresses, if any: scoped to the
    caller's key as its replica scopes it (shared/session_ids.py), except on the
    operator's `/place_session`, which names a session by its id. A name the replica
    would refuse addresses nothing here (the replica answers it with its 400). A stored
    response's id names its conversation's session, in the path or as the
    `previous_response_id` a new response continues."""
    if path.startswith(RESPONSES):
        name = response_session(path[len(RESPONSES) :].split("/", 1)[0])
        return None if name is None else scoped_session_id(tenant, name)
    if body is None:
        return None
    if path == "/v1/responses" and body.get("previous_response_id") is not None:
        name = response_session(body["previous_response_id"])
        return None if name is None else scoped_session_id(tenant, name)
    if path == "/generate":
        params = body.get("session_params")
        name = params.get("id") if isinstance(params, dict) else None
    elif path in SESSION_ROUTES or path.startswith("/v1/"):
        name = body.get("session_id")
    else:
        return None
    if path == "/place_session":
        return name if valid_session_id(name) else None
    return scoped_session_id(tenant, name) if valid_session_name(name) else None


def aborts_all(path: str, body: dict | None) -> bool:
    return path == "/abort_request" and body is not None and body.get("abort_all") is True


def header_session(
    path: str, body: dict | None, headers: MultiMapping[str], header: str, tenant: str | None
) -> str | None:
    """The session a chat request names by the session header: read where the replica
    reads it (no `session_id` in the body, `n` at most 1), scoped to the caller's key. An
    invalid name addresses nothing (the replica answers it, or runs stateless); a
    repeated header raises `RepeatedHeader`."""
    if path not in HEADER_ROUTES or body is None or body.get("session_id") is not None:
        return None
    if body.get("n") not in (None, 1):
        return None  # n > 1 runs stateless there
    name = read_session_header(headers, header)
    return scoped_session_id(tenant, name) if valid_session_name(name) else None


def new_conversation(path: str, body: dict | None) -> bool:
    """A Responses request that begins a stored conversation: its replica opens a session
    for it (named by `session_id`, else by the front), which the front places first, as
    it places a session header's first turn."""
    if path != "/v1/responses" or body is None or body.get("store") is False:
        return False
    return body.get("previous_response_id") is None
