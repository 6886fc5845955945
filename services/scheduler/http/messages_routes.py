"""The Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`,
for the clients and agents written against Anthropic's, on the chat route's machinery:
a request is read as the chat completion it amounts to (messages_input.py), runs as one
(templates, parsers, grammars, `--session-header` sessions exactly as on
/v1/chat/completions, so a conversation sent with the header resumes its session's
state), and is answered as a Message or its events (messages_output.py).

Anthropic's clients send their key as `x-api-key` (shared/tenancy.py reads it as a
bearer key) and an `anthropic-version` header, accepted and ignored. Their failures are
answered in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`) by
errors.py, with the status any other route gives the same failure; a stream that fails
after its headers ends with an `error` event of that body.
"""

from __future__ import annotations

import json
import secrets
from typing import TYPE_CHECKING

from aiohttp import web

from services.scheduler.http.app_keys import CHAT, FRONT_DOOR, SCHEMAS
from services.scheduler.http.events import send_typed_events
from services.scheduler.http.messages_input import MessagesRequest, chat_body
from services.scheduler.http.messages_output import Envelope, events, finished
from services.scheduler.http.openai_routes import Prompt, chat_plan, chat_turn, choices
from services.scheduler.http.retention import hint
from services.scheduler.http.schemas import decode_body
from services.scheduler.records.sampling import InvalidRequest
from services.scheduler.text.reasoning import ReasoningParser
from shared.tenancy import Refused

if TYPE_CHECKING:
    from services.scheduler.http.schemas_openai import OpenAIRequest


def bounds_thinking(request: web.Request) -> bool:
    """Whether the server bounds a reply's reasoning by a budget: its prompt opens the
    reasoning block (chat_tools.py `Thinking`)."""
    parser = request.app[FRONT_DOOR].settings.reasoning_parser
    return bool(parser) and ReasoningParser(parser, True).opened_by_prompt


async def read_request(request: web.Request) -> tuple[MessagesRequest, OpenAIRequest]:
    """The body, and the chat completion request it amounts to."""
    schemas = request.app[SCHEMAS]
    body = decode_body(await request.read(), schemas.messages)
    chat = chat_body(body, bounds_thinking(request))
    return body, decode_body(json.dumps(chat).encode(), schemas.chat_completions)


async def create(request: web.Request) -> web.StreamResponse:
    body, chat = await read_request(request)
    if body.max_tokens is None:
        raise InvalidRequest("invalid request: Object missing required field `max_tokens`")
    session, tokens, turn, plan = await chat_turn(request, chat)
    hint(request, session, body.retention(), body.retention_priority)
    door = request.app[FRONT_DOOR]
    envelope = Envelope(f"msg_{secrets.token_hex(12)}", door.settings.model_name)
    call = choices(request, chat, [Prompt(tokens)], True, session, turn, plan, envelope.id)
    if body.stream:
        return await send_typed_events(request, events(door, call.turns, envelope, plan))
    (done,) = await door.run(call.turns)
    return web.json_response(finished(envelope, plan.reply_message(done), done))


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens as /v1/messages renders them (its tools and thinking switch
    included), none generated."""
    body, chat = await read_request(request)
    served = request.app[FRONT_DOOR].settings.model_name
    if body.model is not None and body.model != served:
        raise Refused(
            404, f"model {body.model!r} is not served here; {served!r} is", "model_not_found"
        )
    plan = chat_plan(request, chat)
    tokens = request.app[CHAT].tokens(plan.messages, True, plan.variables)
    return web.json_response({"input_tokens": len(tokens)})


ROUTES = (
    ("POST", "/v1/messages", create),
    ("POST", "/v1/messages/count_tokens", count_tokens),
)
