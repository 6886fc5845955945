"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (plain or
streamed), with `usage.prompt_tokens_details.cached_tokens`.

A session is named with the extension field `session_id`. An agent loop sends its whole
conversation every time; custody appends to the session what the checkpoint's chat
template renders after the stored conversation (`chat_session.py`, docs/chat.md), so
each turn prefills only its new tokens and has the tokens of the stateless request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from services.scheduler.http import openai_replies
from services.scheduler.http.app_keys import CHAT, FRONT_DOOR, SCHEMAS, TENANCY
from services.scheduler.http.bodies import (
    any_whitespace,
    openai_token_limit,
    prompt_tokens,
    read_body,
)
from services.scheduler.http.chat_session import plan_turn
from services.scheduler.http.chat_tools import Thinking, chat_parsing
from services.scheduler.http.constraints import one, openai_constraint
from services.scheduler.http.edge_sessions import named_session, own_session
from services.scheduler.http.events import send_events
from services.scheduler.http.generation import parallel_params, plain_turns, session_turn
from services.scheduler.http.header_sessions import bind, header_session_name
from services.scheduler.http.openai_replies import Choices, Reply
from services.scheduler.http.retention import hint
from services.scheduler.http.stream_cursor import new_chunks, output_text
from services.scheduler.http.tenancy import CACHE_SALT, Claim
from services.scheduler.records.request import ChatTurn, Request
from services.scheduler.records.sampling import InvalidRequest, SamplingParams
from services.scheduler.records.session import Session
from services.scheduler.records.turn import Turn
from services.scheduler.runtime.front_door import FrontDoor
from services.scheduler.text.assistant_reply import ReplyParser, ReplyStream
from shared.messages.grammar import GrammarSpec
from shared.tenancy import Refused

if TYPE_CHECKING:
    from services.scheduler.http.schemas_openai import OpenAIRequest

DEFAULT_MAX_TOKENS = {"completions": 16, "chat": 128}
ID_PREFIX = {False: "cmpl-", True: "chatcmpl-"}  # of the reply's id: its first choice's


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request, tokenized; `echo`: the text each of its choices begins
    with (completions' echo), else None."""

    tokens: list[int]
    echo: str | None = None


async def respond(request: web.Request, call: Choices) -> web.StreamResponse:
    """Answer a completion or chat completion, whole or streamed."""
    door = request.app[FRONT_DOOR]
    if call.reply.stream:
        return await send_events(request, openai_replies.chunks(door, call))
    return web.json_response(openai_replies.whole(door.tokenizer, call, await door.run(call.turns)))


def choices(
    request: web.Request,
    body: OpenAIRequest,
    prompts: list[Prompt],
    chat: bool,
    session: Session | None,
    turn: ChatTurn | None = None,
    plan: ChatPlan | None = None,
    rid: str | None = None,
) -> Choices:
    """A completion or chat completion's requests, checked: `n` choices per prompt, each
    its own request, indexed in prompt order; `session`: the turn's, resolved once;
    `plan`: a chat's tool calls and reasoning (chat_tools.py); `rid`: the first
    choice's id, if its route names it."""
    door = request.app[FRONT_DOOR]
    served = door.settings.model_name
    if body.model is not None and body.model != served:  # absent: the served one
        raise Refused(
            404, f"model {body.model!r} is not served here; {served!r} is", "model_not_found"
        )
    n = body.n or 1
    if body.cache_salt is not None:
        request[CACHE_SALT] = body.cache_salt
    if n * len(prompts) > 1 and session is not None:
        raise InvalidRequest(
            "n > 1 or a batch of prompts cannot continue a session: a session turn has one reply"
        )
    field, requested = body.requested_tokens()
    default = DEFAULT_MAX_TOKENS["chat" if chat else "completions"]
    history = 0 if session is None else session.history.size
    parser, thinking = (None, None) if plan is None else (plan.parser, plan.thinking)
    tool_grammar = None if plan is None else plan.grammar
    constraints = {"constraint": openai_constraint(body, any_whitespace(request))}
    grammar = one(constraints | {"tool_choice": tool_grammar})
    planned = []
    for prompt in prompts:
        limit = openai_token_limit(request, session, len(prompt.tokens), field, requested, default)
        held = grammar if thinking is None else thinking.constrain(grammar, limit)
        params = body.engine_params(limit, history, held)
        planned += [(prompt, p) for p in parallel_params(params, n)]
    tenancy = request.app[TENANCY]
    claims = [tenancy.claim(request, rid, ID_PREFIX[chat])]
    claims += [tenancy.claim(request, None) for _ in planned[1:]]
    reply = Reply(claims[0].shown, chat, body.stream, served, parser)
    return Choices(
        turns=choice_turns(request, claims, planned, session, turn),
        reply=reply,
        echoes=[prompt.echo for prompt, _ in planned],
        n=n,
        details=bool(body.return_cached_tokens_details),
        include_usage=body.include_usage(),
        running=body.include_usage() and body.continuous_usage(),
    )


def choice_turns(
    request: web.Request,
    claims: list[Claim],
    planned: list[tuple[Prompt, SamplingParams]],
    session: Session | None,
    turn: ChatTurn | None,
) -> list[Turn]:
    """One choice: a plain request or a session's turn; more: plain requests at once."""
    if len(planned) > 1:
        jobs = [(c, p.tokens, params) for c, (p, params) in zip(claims, planned, strict=True)]
        return plain_turns(request, jobs)
    (prompt, params), claim = planned[0], claims[0]
    return session_turn(request, claim, prompt.tokens, params, session, None, turn)


async def models(request: web.Request) -> web.Response:
    door = request.app[FRONT_DOOR]
    card = {"id": door.settings.model_name, "object": "model", "created": 0}
    root = str(door.settings.model) if door.settings.model else door.settings.model_name
    card |= {"owned_by": "custody", "root": root, "max_model_len": door.context_len}
    return web.json_response({"object": "list", "data": [card]})


async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_body(request, request.app[SCHEMAS].completions)
    session = named_session(request, body.session_id)  # its one lookup
    decode = request.app[FRONT_DOOR].tokenizer.decode
    prompts = []
    for prompt in body.prompts():
        text = isinstance(prompt, str)
        tokens = prompt_tokens(request, prompt, session) if text else prompt
        echo = (prompt if text else decode(prompt)) if body.echo else None
        prompts.append(Prompt(tokens, echo))
    hint(request, session, body.cache_control, body.retention_priority)
    return await respond(request, choices(request, body, prompts, False, session))


@dataclass(frozen=True)
class ChatPlan:
    """A chat request read once: its messages as the template sees them, its template
    variables, and what its tools and thinking switch make of the reply (chat_tools.py)."""

    messages: list[dict]
    variables: dict
    parser: ReplyParser | None
    grammar: GrammarSpec | None
    thinking: Thinking | None

    def reply_message(self, r: Request) -> dict:
        """The turn's reply as the client gets it, and sends it back."""
        if self.parser is None:
            return {"role": "assistant", "content": output_text(r)}
        message, _ = self.parser.message(r.rid, output_text(r))
        return {k: v for k, v in message.items() if v is not None}

    async def deltas(
        self, door: FrontDoor, turns: list[Turn]
    ) -> AsyncIterator[tuple[Request, dict]]:
        """The reply's chat deltas (`content`, `reasoning_content`, `tool_calls`) as the
        steps bring its tokens, each with its request, at least one per chunk (`{}` when
        the parser holds the chunk's text back): what the Responses and Messages streams
        write as their own events."""
        stream = None
        async with aclosing(new_chunks(door, turns)) as news:
            async for _, r, chunk in news:
                if self.parser is None:
                    yield r, {"content": chunk.delta}
                    continue
                stream = stream or ReplyStream(self.parser, r.rid)
                for delta in stream.deltas(chunk.text, r.done) or [{}]:
                    yield r, delta


def chat_plan(request: web.Request, body: OpenAIRequest) -> ChatPlan:
    door = request.app[FRONT_DOOR]
    parser, grammar, thinking = chat_parsing(door.settings, body, door.tokenizer)
    messages = request.app[CHAT].messages([msgspec.to_builtins(m) for m in body.messages])
    return ChatPlan(messages, body.template_variables(), parser, grammar, thinking)


async def chat(request: web.Request) -> web.StreamResponse:
    body = await read_body(request, request.app[SCHEMAS].chat_completions)
    session, tokens, turn, plan = await chat_turn(request, body)
    hint(request, session, body.cache_control, body.retention_priority)
    return await respond(
        request, choices(request, body, [Prompt(tokens)], True, session, turn, plan)
    )


async def chat_turn(
    request: web.Request, body: OpenAIRequest
) -> tuple[Session | None, list[int], ChatTurn | None, ChatPlan]:
    """A chat request's session (by `session_id`, else by the session header, else
    none), its prompt's tokens, its turn on that session and its plan."""
    encoder, sid, plan = request.app[CHAT], body.session_id, chat_plan(request, body)
    messages, variables = plan.messages, plan.variables
    named = header_session_name(request) if sid is None and (body.n or 1) == 1 else None
    if named is not None:
        bound = await bind(request, named, encoder, messages, variables, plan.reply_message)
        if bound is not None:
            return *bound, plan
    if sid is None:
        return None, encoder.tokens(messages, True, variables), None, plan
    session = own_session(request, sid)  # the one lookup of its session
    tokens, turn = plan_turn(encoder, session, messages, variables, plan.reply_message)
    return session, tokens, turn, plan


ROUTES = (
    ("GET", "/v1/models", models),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/chat/completions", chat),
)
