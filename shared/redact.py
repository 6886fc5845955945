"""Secrets kept out of logs and printed lines: a Redis URL may carry a password."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"


def masked_url(url: str) -> str:
    """`url` with its password (in the userinfo or a `password=` query parameter)
    replaced by ***, for logging. A userinfo without a colon is masked too: some clients
    read a lone `secret@host` as the password. Anything unparsable is masked whole."""
    try:
        parts = urlsplit(url)
        _, at, host = parts.netloc.rpartition("@")
        if at:
            has_password = parts.password is not None
            shown = f"{parts.username or ''}:{MASK}" if has_password else MASK
            parts = parts._replace(netloc=f"{shown}@{host}")
        query = parse_qsl(parts.query, keep_blank_values=True)
        if any(k == "password" for k, _ in query):
            masked = [(k, MASK if k == "password" else v) for k, v in query]
            parts = parts._replace(query=urlencode(masked, safe="*"))
        return urlunsplit(parts)
    except ValueError:
        return MASK
