"""The session header (`--session-header`), read one way by every hop that reads it: the
replica, the router and the endpoint picker (fronts/addressing.py)."""

from __future__ import annotations

from multidict import MultiMapping


class RepeatedHeader(ValueError):
    """The session header sent more than once: refused (400) by the router, the picker
    and the replica alike, since no rule for which copy counts is shared by every hop
    (Envoy passes each copy on, aiohttp reads the first, a dict keeps the last)."""


def read_session_header(headers: MultiMapping[str], header: str) -> str | None:
    """The value of the session header `header` (None: no header configured, or none
    sent); raises `RepeatedHeader`."""
    values = headers.getall(header, []) if header else []
    if len(values) > 1:
        raise RepeatedHeader(f"the {header} header is sent {len(values)} times; send it once")
    return values[0] if values else None
