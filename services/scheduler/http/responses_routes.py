"""The OpenAI Responses API on sessions (docs/api.md "Responses"): `POST /v1/responses`,
`GET` and `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`.

A stored conversation is one session, and its responses a tree in that session
(records/response_tree.py), stored by the record write of each turn's history. A
response's id names its session (`resp_<session>_<token>`), so a front routes it to
the replica that holds it, and a key reaches only its own (another key's id is the
same 404 as an unknown one). `previous_response_id` naming the response the session's
state ends at appends a turn that resumes that state; naming another one re-seeds the
session on that branch (http/header_sessions.py's rule), whose turn resumes from the
deepest state the prefix cache kept on it (docs/ownership.md "Kept boundaries"). A
session has one turn at a time: a second response of the same conversation while one
runs is a 409. `store: false` runs stateless and stores nothing.
"""

from __future__ import annotations

import json
import logging
import secrets

from aiohttp import web

from services.scheduler.http.app_keys import CHAT, FRONT_DOOR, SCHEMAS
from services.scheduler.http.chat_session import plan_turn
from services.scheduler.http.edge_sessions import own_session
from services.scheduler.http.events import send_typed_events
from services.scheduler.http.limits import open_session_within_limits
from services.scheduler.http.openai_routes import ChatPlan, Prompt, chat_plan, choices
from services.scheduler.http.responses_input import ResponsesRequest, chat_body, new_messages
from services.scheduler.http.responses_output import Envelope, events, finished
from services.scheduler.http.retention import hint
from services.scheduler.http.schemas import decode_body
from services.scheduler.records.request import ChatTurn, Request
from services.scheduler.records.sampling import InvalidRequest
from services.scheduler.records.session import Session, SessionError
from shared.messages.ownership import ResponseEntry
from shared.placement import PLACED_HEADER
from shared.session_ids import response_id, response_session
from shared.tenancy import Refused

log = logging.getLogger("custody.scheduler.responses")


def not_found(rid: str) -> Refused:
    return Refused(404, f"no response {rid!r} (deleted, forgotten, or not yours)", "not_found")


def stored(request: web.Request, rid: str) -> tuple[Session, ResponseEntry]:
    """The caller's stored response `rid` and its session; 404 if none."""
    name = response_session(rid)
    if name is None:
        raise not_found(rid)
    try:
        session = own_session(request, name)
    except SessionError as err:
        if err.kind in ("not_found", "closed"):
            raise not_found(rid) from None
        raise
    node = session.responses.get(rid)
    if node is None:
        raise not_found(rid)
    return session, node


async def conversation_session(request: web.Request, name: str | None) -> Session:
    """The session of a new conversation: named by the request (a front names it when
    it places it), else a new name; opened here unless open already."""
    name = name or secrets.token_hex(12)
    try:
        return own_session(request, name)
    except SessionError as err:
        if err.kind not in ("not_found", "closed"):
            raise
    session = open_session_within_limits(request, name, None)
    session.routed = request.headers.get(PLACED_HEADER) == "1"
    await request.app[FRONT_DOOR].durable()
    return session


async def create(request: web.Request) -> web.StreamResponse:
    raw, door = await request.read(), request.app[FRONT_DOOR]
    body = decode_body(raw, request.app[SCHEMAS].responses)
    session, parent, conversation = None, "", []
    if body.previous_response_id is not None:
        session, node = stored(request, body.previous_response_id)
        parent, conversation = node.id, session.responses.conversation(node.id)
    elif body.stored:
        session = await conversation_session(request, body.session_id)
    chat = chat_body(body, conversation)
    try:
        chat_request = decode_body(json.dumps(chat).encode(), request.app[SCHEMAS].chat_completions)
    except InvalidRequest as err:
        raise InvalidRequest(
            str(err).replace("max_completion_tokens", "max_output_tokens")
        ) from None
    plan = chat_plan(request, chat_request)
    name = session.name if session is not None else secrets.token_hex(12)
    rid = response_id(name, secrets.token_hex(8))
    envelope = Envelope(rid, door.settings.model_name, body)
    turn = None
    if not body.stored:
        session = None
        tokens = request.app[CHAT].tokens(plan.messages, True, plan.variables)
    else:
        session, tokens, turn = bound_turn(request, session, plan)
        added = new_messages(body.input)

        def store(r: Request) -> ResponseEntry | None:
            """Run by the engine as the turn finishes; it must not raise."""
            try:
                reply = plan.reply_message(r)
                obj = finished(envelope, reply, r) | {"input_items": input_items(body)}
                return ResponseEntry(rid, parent, _json([*added, reply]), _json(obj))
            except Exception:
                log.exception("response %s: not stored", rid)
                return None

        turn.stored = store
        hint(request, session, body.cache_control, body.retention_priority)
    call = choices(request, chat_request, [Prompt(tokens)], True, session, turn, plan, rid)
    if body.stream:
        stream = events(door, call.turns, envelope, plan)
        return await send_typed_events(request, stream, done=True)
    (done,) = await door.run(call.turns)
    return web.json_response(finished(envelope, plan.reply_message(done), done))


def bound_turn(
    request: web.Request, session: Session, plan: ChatPlan
) -> tuple[Session, list[int], ChatTurn]:
    """The turn on `session` that renders `plan`'s messages: an append when they extend
    the conversation its state ends at, else the session re-seeded on their branch."""
    encoder, door = request.app[CHAT], request.app[FRONT_DOOR]
    args = (encoder, session, plan.messages, plan.variables, plan.reply_message)
    try:
        return session, *plan_turn(*args)
    except SessionError as err:
        if err.kind != "conflict":
            raise
    if session.turn is not None:
        raise SessionError(
            f"a response of this conversation is in progress (session {session.name}); "
            "retry once it has finished",
            "busy",
        )
    session = door.reseed_session(session)
    return session, *plan_turn(encoder, session, plan.messages, plan.variables, plan.reply_message)


def input_items(body: ResponsesRequest) -> list[dict]:
    """The request's input as items, each with an id (`GET .../input_items`)."""
    if isinstance(body.input, str):
        items = [
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": body.input}],
            }
        ]
    else:
        items = [dict(item) for item in body.input]
    for i, item in enumerate(items):
        item.setdefault("type", "message")
        if item["type"] == "message":
            item.setdefault("status", "completed")
            if isinstance(item.get("content"), str):
                item["content"] = [{"type": "input_text", "text": item["content"]}]
        item.setdefault("id", f"item_{i}")
    return items


def _json(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


async def retrieve(request: web.Request) -> web.Response:
    _, node = stored(request, request.match_info["response_id"])
    obj = json.loads(node.body)
    obj.pop("input_items", None)
    return web.json_response(obj)


async def delete(request: web.Request) -> web.Response:
    """A deleted response is named no more; the responses that continue it keep their
    conversations (it is part of them). A conversation whose every response is deleted
    closes its session, which frees its state."""
    rid = request.match_info["response_id"]
    session, _ = stored(request, rid)
    door = request.app[FRONT_DOOR]
    door.delete_response(session, rid)
    if not session.responses.live and session.turn is None:
        await door.close_session(session)
        await door.close_recorded(session)
    else:
        await door.durable()
    return web.json_response({"id": rid, "object": "response", "deleted": True})


async def list_input_items(request: web.Request) -> web.Response:
    """The response's input items, newest first unless `order=asc` (OpenAI's default),
    `limit` of them (1..100, 20) after the item `after` names."""
    _, node = stored(request, request.match_info["response_id"])
    items = list(json.loads(node.body).get("input_items", []))
    query = request.query
    if query.get("order", "desc") not in ("asc", "desc"):
        raise InvalidRequest("order must be asc or desc")
    if query.get("order", "desc") == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        raise InvalidRequest("limit must be an integer from 1 to 100") from None
    if not 1 <= limit <= 100:
        raise InvalidRequest("limit must be an integer from 1 to 100")
    page = items[:limit]
    return web.json_response(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )


async def not_served(request: web.Request) -> web.Response:
    """`/cancel` and `/compact`: refused by name (there are no background responses to
    cancel, and a conversation is never compacted behind its client's back)."""
    route = request.path.rsplit("/", 1)[-1]
    raise InvalidRequest(f"/v1/responses {route} is not served by custody (docs/api.md)")


ROUTES = (
    ("POST", "/v1/responses", create),
    ("POST", "/v1/responses/compact", not_served),
    ("POST", "/v1/responses/{response_id}/cancel", not_served),
    ("GET", "/v1/responses/{response_id}", retrieve),
    ("DELETE", "/v1/responses/{response_id}", delete),
    ("GET", "/v1/responses/{response_id}/input_items", list_input_items),
)
