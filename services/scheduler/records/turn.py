"""A generation as the HTTP edge hands it to the core: decoded and checked once, in one
typed value (its ids and tenant, input, sampling, session, chat conversation and cache
namespace), so the core never reads a request body and the edge never passes a turn in
loose pieces."""

from __future__ import annotations

import msgspec

from services.scheduler.records.request import ChatTurn
from services.scheduler.records.sampling import SamplingParams
from services.scheduler.records.session import Session


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    rid: str  # the server's id
    shown: str  # the id its client knows it by (tenancy.py `Claim`)
    tenant: str | None = None  # the API key it runs for (None: keys off)
    tokens: list[int]  # the prompt; a session turn's new input only
    params: SamplingParams
    # the session it continues, resolved once at the edge (edge_sessions.py)
    session: Session | None = None
    session_options: dict = {}  # a /generate turn's session_params, what a later turn names
    chat: ChatTurn | None = None  # a chat turn's conversation (chat_session.py)
    cache_namespace: str = ""  # the prefix cache it may match and feed (tenancy.py)
