"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (plain or
streamed), with `usage.prompt_tokens_details.cached_tokens`.

A session is named with the extension field `session_id`. An agent loop sends its whole
conversation every time; custody appends to the session what the checkpoint's chat
template renders after the stored conversation (`chat_session.py`, docs/chat.md), so
each turn prefills only its new tokens and has the tokens of the stateless request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

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
from services.scheduler.http.events import EventStream, StreamCursor, output_text
from services.scheduler.http.generation import Job, parallel_params, run_all, run_generation
from services.scheduler.http.header_sessions import bind, header_session_name
from services.scheduler.http.logprobs import echoed_prompt, joined
from services.scheduler.http.logprobs import openai as openai_logprobs
from services.scheduler.http.tenancy import CACHE_SALT
from services.scheduler.records.finish import FinishReason
from services.scheduler.records.request import ChatTurn, Request
from services.scheduler.records.sampling import InvalidRequest
from services.scheduler.records.session import Session
from services.scheduler.runtime.front_door import Progress
from services.scheduler.text.assistant_reply import ReplyParser, ReplyStream
from shared.messages.grammar import GrammarSpec
from shared.tenancy import Refused
from shared.tokenizer import Tokenizer

if TYPE_CHECKING:
    from services.scheduler.http.schemas_openai import OpenAIRequest

DEFAULT_MAX_TOKENS = {"completions": 16, "chat": 128}
ID_PREFIX = {False: "cmpl-", True: "chatcmpl-"}  # of the reply's id: its first choice's


def usage(reqs: list[Request], n: int) -> dict:
    """Of all choices (`n` per prompt): each prompt counted once (as OpenAI counts it),
    the completions summed; `cached_tokens`: per prompt the fewest any of its choices
    reused, summed."""
    by_prompt = [reqs[i : i + n] for i in range(0, len(reqs), n)]
    prompt = sum(len(group[0].prompt) for group in by_prompt)
    completion = sum(len(r.output) for r in reqs)
    cached = sum(min(r.cached_tokens for r in group) for group in by_prompt)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def sglext(cached: int) -> dict:
    """SGLang's extension field with `cached_tokens_details`: custody counts every reused
    token as `device` (a session's state brought back from a lower tier is on the device
    before its turn runs)."""
    return {"cached_tokens_details": {"device": cached, "host": 0}}


def accounting(reqs: list[Request], n: int, details: bool) -> dict:
    """A reply's `usage` and, with `details`, its `sglext` of the same cached count."""
    spent = usage(reqs, n)
    cached = spent["prompt_tokens_details"]["cached_tokens"]
    return {"usage": spent} | ({"sglext": sglext(cached)} if details else {})


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request, tokenized; `echo`: the text each of its choices begins
    with (completions' echo), else None."""

    tokens: list[int]
    echo: str | None = None


def ending(req: Request) -> FinishReason | None:
    """Why `req` ended; None while it runs (a stream's chunk before its last)."""
    return req.finish_reason if req.done else None


class Reply:
    """The envelope of one completion or chat completion, whole or as chunks."""

    def __init__(
        self, rid: str, chat: bool, stream: bool, model: str, parser: ReplyParser | None = None
    ) -> None:
        """`parser`: a chat reply's reasoning and tool calls (chat_tools.py); None: its
        text is its content."""
        self.rid, self.chat, self.stream, self.model = rid, chat, stream, model
        self.parser = parser
        self.kind = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())

    def choice(
        self, text: str, logprobs: dict | None, reason: FinishReason | None, index: int = 0
    ) -> dict:
        """`logprobs`: of the tokens the choice (or chunk) covers; None when not asked.
        `reason`: why it ended (None: a chunk of a choice still running), given as
        OpenAI's `finish_reason` (`stop`, `length`, or `abort` for an aborted request, as
        vLLM reports it) and SGLang's `matched_stop` (the stop token id or string)."""
        ended = {
            "finish_reason": None if reason is None else reason.type,
            "matched_stop": None if reason is None else reason.matched,
        }
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs} | ended
        part = "message" if reason is not None and not self.stream else "delta"
        message = {part: {"role": "assistant", "content": text}, "logprobs": logprobs}
        return {"index": index} | ended | message

    def parsed_choice(
        self, rid: str, text: str, logprobs: dict | None, reason: FinishReason, index: int
    ) -> dict:
        """A whole chat choice through the parser: `finish_reason` `tool_calls` when
        the model called tools and stopped by itself."""
        message, called = self.parser.message(rid, text)
        choice = self.choice(text, logprobs, reason, index)
        if called and reason.type == "stop":
            choice["finish_reason"] = "tool_calls"
        return choice | {"message": message}

    def delta_chunks(
        self, stream: ReplyStream, r: Request, text: str, logprobs: dict | None, index: int
    ) -> list[dict]:
        """A streamed chat choice's chunks for its reply so far (`text`), through the
        parser; the last carries the finish reason once it ended."""
        reason = ending(r)
        deltas = stream.deltas(text, reason is not None)
        if reason is not None or not deltas:
            deltas.append({})
        chunks = []
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            choice = self.choice("", logprobs if i == 0 else None, reason if last else None, index)
            if last and reason is not None and stream.called and reason.type == "stop":
                choice["finish_reason"] = "tool_calls"
            chunks.append(choice | {"delta": delta | ({"role": "assistant"} if i == 0 else {})})
        return chunks

    def body(self, choices: list[dict], **extra: object) -> dict:
        kind = f"{self.kind}.chunk" if self.stream else self.kind
        head = {"id": self.rid, "object": kind, "created": self.created, "model": self.model}
        return head | {"choices": choices} | extra


async def respond(
    request: web.Request,
    body: OpenAIRequest,
    prompts: list[Prompt],
    chat: bool,
    session: Session | None,
    turn: ChatTurn | None = None,
    parser: ReplyParser | None = None,
    tool_grammar: GrammarSpec | None = None,
    thinking: Thinking | None = None,
) -> web.StreamResponse:
    """Answer a completion or chat completion: `n` choices per prompt, each its own
    request, indexed in prompt order; `session`: the turn's, resolved once; `parser`,
    `tool_grammar` and `thinking`: a chat's tool calls and reasoning (chat_tools.py)."""
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
    constraints = {"constraint": openai_constraint(body, any_whitespace(request))}
    grammar = one(constraints | {"tool_choice": tool_grammar})
    planned = []
    for prompt in prompts:
        limit = openai_token_limit(request, session, len(prompt.tokens), field, requested, default)
        held = grammar if thinking is None else thinking.constrain(grammar, limit)
        params = body.engine_params(limit, history, held)
        planned += [(prompt, p) for p in parallel_params(params, n)]
    tenancy = request.app[TENANCY]
    claims = [tenancy.claim(request, None, ID_PREFIX[chat])]
    claims += [tenancy.claim(request, None) for _ in planned[1:]]
    reply = Reply(claims[0].shown, chat, body.stream, served, parser)
    jobs = [Job(c.server, p.tokens, params) for c, (p, params) in zip(claims, planned, strict=True)]
    echoes = [prompt.echo for prompt, _ in planned]
    details = bool(body.return_cached_tokens_details)
    running = body.include_usage() and body.continuous_usage()
    if not body.stream:
        done = await run_choices(request, jobs, session, turn)
        choices = []
        for i, (r, echo) in enumerate(zip(done, echoes, strict=True)):
            text, lps = echoed(
                door.tokenizer, r, echo, output_text(r), chat, offset=len(echo or "")
            )
            if parser is None:
                choices.append(reply.choice(text, lps, r.finish_reason, i))
            else:
                choices.append(reply.parsed_choice(r.rid, text, lps, r.finish_reason, i))
        return web.json_response(reply.body(choices, **accounting(done, n, details)))
    sse = EventStream(request)
    jobs = [
        replace(job, progress=streamer(request, reply, sse, i, echo, details, running))
        for i, (job, echo) in enumerate(zip(jobs, echoes, strict=True))
    ]
    done = await run_choices(request, jobs, session, turn)
    if body.include_usage():
        await sse.send(reply.body([], **accounting(done, n, details)))
    await sse.send("[DONE]")
    return sse.response


async def run_choices(
    request: web.Request, jobs: list[Job], session: Session | None, turn: ChatTurn | None
) -> list[Request]:
    """One choice: a plain request or a session's turn; more: plain requests at once."""
    if len(jobs) > 1:
        return await run_all(request, jobs)
    job = jobs[0]
    return [
        await run_generation(
            request, job.rid, job.tokens, job.params, session, {}, job.progress, turn
        )
    ]


def echoed(
    tokenizer: Tokenizer,
    r: Request,
    head: str | None,
    text: str,
    chat: bool,
    start: int = 0,
    end: int | None = None,
    offset: int = 0,
) -> tuple[str, dict | None]:
    """A choice's (or chunk's) text and the logprobs of output tokens [start, end), the
    first `offset` characters into the choice's text; with `head` (the echoed prompt),
    the prompt's text and logprobs come first."""
    lps = openai_logprobs(tokenizer, r, chat, start, end, offset)
    if head is None:
        return text, lps
    if lps is not None:
        lps = joined(echoed_prompt(tokenizer, r), lps, 0)
    return head + text, lps


def streamer(
    request: web.Request,
    reply: Reply,
    sse: EventStream,
    index: int,
    echo: str | None,
    details: bool = False,
    running: bool = False,
) -> Progress:
    """The chunks of choice `index`: its new text, and the logprobs of the tokens that
    arrived since its chunk before; with `echo`, the first chunk begins with the prompt
    (its text and logprobs), as vLLM's does; with `details`, the finishing chunk carries
    the choice's `sglext` (SGLang's); with `running` (vLLM's continuous usage stats),
    each chunk its choice's `usage` so far."""
    door = request.app[FRONT_DOOR]
    tokenizer, cursor = door.tokenizer, StreamCursor(door.settings.stream_interval)
    head = echo
    parsed: ReplyStream | None = None

    async def progress(r: Request) -> None:
        nonlocal head, parsed
        chunk = cursor.next(r)
        if chunk is not None and reply.parser is not None:
            parsed = parsed or ReplyStream(reply.parser, r.rid)
            lps = openai_logprobs(tokenizer, r, True, chunk.start, chunk.end, 0)
            extra = {"sglext": sglext(r.cached_tokens)} if details and r.done else {}
            if running:
                extra["usage"] = usage([r], 1)
            for choice in reply.delta_chunks(parsed, r, chunk.text, lps, index):
                await sse.send(reply.body([choice], **extra))
        elif chunk is not None:
            sent = len(chunk.text) - len(chunk.delta)  # text_offset counts from there
            offset = sent + len(echo or "")
            text, lps = echoed(
                tokenizer, r, head, chunk.delta, reply.chat, chunk.start, chunk.end, offset
            )
            head = None
            choice = reply.choice(text, lps, ending(r), index)
            extra = {"sglext": sglext(r.cached_tokens)} if details and r.done else {}
            if running:
                extra["usage"] = usage([r], 1)
            await sse.send(reply.body([choice], **extra))

    return progress


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
    return await respond(request, body, prompts, False, session)


async def chat(request: web.Request) -> web.StreamResponse:
    body = await read_body(request, request.app[SCHEMAS].chat_completions)
    encoder, sid = request.app[CHAT], body.session_id
    door = request.app[FRONT_DOOR]
    parser, grammar, thinking = chat_parsing(door.settings, body, door.tokenizer)
    messages = encoder.messages([msgspec.to_builtins(m) for m in body.messages])
    variables = body.template_variables()

    def reply_message(r: Request) -> dict:
        """The turn's reply as the client gets it, and sends it back."""
        if parser is None:
            return {"role": "assistant", "content": output_text(r)}
        message, _ = parser.message(r.rid, output_text(r))
        return {k: v for k, v in message.items() if v is not None}

    named = header_session_name(request) if sid is None and (body.n or 1) == 1 else None
    if named is not None:
        bound = await bind(request, named, encoder, messages, variables, reply_message)
        if bound is not None:
            session, tokens, turn = bound
            return await respond(
                request, body, [Prompt(tokens)], True, session, turn, parser, grammar, thinking
            )
    if sid is None:
        tokens = encoder.tokens(messages, True, variables)
        return await respond(
            request, body, [Prompt(tokens)], True, None, None, parser, grammar, thinking
        )
    session = own_session(request, sid)  # the one lookup of its session
    tokens, turn = plan_turn(encoder, session, messages, variables, reply_message)
    return await respond(
        request, body, [Prompt(tokens)], True, session, turn, parser, grammar, thinking
    )


ROUTES = (
    ("GET", "/v1/models", models),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/chat/completions", chat),
)
