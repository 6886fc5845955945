"""Sessions for clients that cannot send `session_id`: with `--session-header NAME`, a
stateless chat request carrying that header is a turn of the caller's session of that
name, opened on first use. Agent frameworks send the whole conversation every time and
a conversation id in a header (`X-Session-ID`, Dynamo's `X-Dynamo-Session-ID`).

The answer is always what the same request without the header gets (chat.md's rule
that a session turn equals the stateless request): when the messages extend the
session's stored conversation, the turn resumes from the session's state; when they do
not (another branch, an edited message, a retry of the same turn), the session is
re-seeded (its state and conversation dropped, its identity and placement kept) and
the turn runs as its first, resuming from the deepest state the prefix cache holds on
the prompt it shares with the conversation before (docs/ownership.md, "Kept
boundaries"). A session with
a turn in flight, or a conversation a first turn cannot take at once (more than
`MAX_NEW_MESSAGES` messages), runs stateless and leaves the session as it was.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from services.scheduler.http.app_keys import FRONT_DOOR
from services.scheduler.http.chat_session import MAX_NEW_MESSAGES, plan_turn
from services.scheduler.http.edge_sessions import own_session
from services.scheduler.http.limits import open_session_within_limits
from services.scheduler.records.request import ChatTurn, Request
from services.scheduler.records.sampling import InvalidRequest
from services.scheduler.records.session import Session, SessionError
from services.scheduler.text.chat_tokens import ChatEncoder
from shared.placement import PLACED_HEADER
from shared.session_header import RepeatedHeader, read_session_header

Bound = tuple[Session, list[int], ChatTurn]


def header_session_name(request: web.Request) -> str | None:
    """The session name the request's header gives, if the server binds one; the header
    sent twice is refused, as the router and the endpoint picker refuse it."""
    try:
        return read_session_header(request.headers, request.app[FRONT_DOOR].settings.session_header)
    except RepeatedHeader as err:
        raise InvalidRequest(str(err)) from None


async def bind(
    request: web.Request,
    name: str,
    encoder: ChatEncoder,
    messages: list[dict],
    variables: dict,
    reply_message: Callable[[Request], dict],
) -> Bound | None:
    """The turn of session `name` these messages make (opening or re-seeding it), or
    None to run the request stateless."""
    door = request.app[FRONT_DOOR]
    try:
        session, outcome = own_session(request, name), "resumed"
    except SessionError as err:
        if err.kind not in ("not_found", "closed"):
            raise
        session, outcome = await _open(request, name), "opened"
    if session.turn is not None or (len(messages) > MAX_NEW_MESSAGES and outcome == "opened"):
        door.count_header_turn("stateless")  # a turn in flight, or too much for a first turn
        return None
    try:
        bound = session, *plan_turn(encoder, session, messages, variables, reply_message)
    except (SessionError, InvalidRequest) as err:
        if isinstance(err, SessionError) and err.kind != "conflict":
            raise
        if len(messages) > MAX_NEW_MESSAGES:
            door.count_header_turn("stateless")
            return None
        session, outcome = door.reseed_session(session), "reseeded"
        bound = session, *plan_turn(encoder, session, messages, variables, reply_message)
    door.count_header_turn(outcome)
    return bound


async def _open(request: web.Request, name: str) -> Session:
    """Open the caller's session `name` as `/open_session` does."""
    session = open_session_within_limits(request, name, None)
    session.routed = request.headers.get(PLACED_HEADER) == "1"
    await request.app[FRONT_DOOR].durable()
    return session
