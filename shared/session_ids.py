"""Session ids: the name a client gives a session, and the id custody keeps it under.

With API keys on, each key has its own namespace of session names: two keys may both
open "x", and no key can learn whether another's "x" exists (every miss is a 404). The
edges (router and scheduler) turn a client's name into its *scoped* id, the name and a
tag of the key's tenant hash, and everything behind them (the engine, Redis keys, the
ownership stream, the session store, operator routes) knows a session by that id only.
A name never contains the separator, so a scoped id names exactly one (name, key) pair.
With keys off there is one namespace and a session's id is its name."""

from __future__ import annotations

import hashlib
import re

# A session name, as clients may choose it; part of Redis keys and log lines, so never
# `.` or `..`. Written for JSON Schema (ECMA), where `$` is the end; Python's `$` also
# matches before a final newline, so `valid_session_name` matches it with `fullmatch`.
SESSION_ID = re.compile(r"^(?!\.\.?$)[A-Za-z0-9._:-]{1,128}$")
SEPARATOR = "~"  # never in a name
TAG_CHARS = 32  # hex digits of the tenant hash (128 bits) a scoped id carries
_NAME = r"(?!\.\.?(~|$))[A-Za-z0-9._:-]{1,128}"
_SCOPED = re.compile(rf"{_NAME}({SEPARATOR}[0-9a-f]{{{TAG_CHARS}}})?")


def valid_session_name(name: object) -> bool:
    return isinstance(name, str) and SESSION_ID.fullmatch(name) is not None


def tenant_of(key: str) -> str:
    """The tenant of an API key (its sha256, hex): what owns its sessions, never the key."""
    return hashlib.sha256(key.encode()).hexdigest()


def scoped_session_id(tenant: str | None, name: str) -> str:
    """The id of the session `name` of `tenant` (a key's sha256 hex; None: keys off)."""
    return name if tenant is None else f"{name}{SEPARATOR}{tenant[:TAG_CHARS]}"


def session_name(sid: str) -> str:
    """What the session's client calls it."""
    return sid.partition(SEPARATOR)[0]


def valid_session_id(sid: object) -> bool:
    """A scoped id (or, keys off, a name): what the engine and operator routes take."""
    return isinstance(sid, str) and _SCOPED.fullmatch(sid) is not None


# A stored response's id (the Responses API, docs/api.md) names its conversation's
# session, so every front routes it where that session lives: `resp_<name>_<token>`
# (a name holds no `_`).
RESPONSE_PREFIX = "resp_"


def response_id(name: str, token: str) -> str:
    return f"{RESPONSE_PREFIX}{name}_{token}"


def response_session(rid: object) -> str | None:
    """The name of the session response id `rid` names; None if it names none."""
    if not isinstance(rid, str) or not rid.startswith(RESPONSE_PREFIX):
        return None
    name, sep, _ = rid[len(RESPONSE_PREFIX) :].rpartition("_")
    return name if sep and valid_session_name(name) else None
