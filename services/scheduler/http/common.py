"""What both HTTP route modules use: JSON errors, typed bodies, the output budget,
server-sent events, and resolving the session a request names (with API keys on, only the
key that opened a session may use it)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TypeVar

import msgspec
from aiohttp import web

from services.scheduler.engine.validation import output_budget
from services.scheduler.http.app_keys import FRONT_DOOR
from services.scheduler.http.limits import check_queue
from services.scheduler.http.schemas import decode_body
from services.scheduler.http.tenancy import cache_namespace_of, session_id
from services.scheduler.records.request import ChatTurn, Request
from services.scheduler.records.sampling import SamplingParams
from services.scheduler.records.session import Session
from services.scheduler.runtime.front_door import Progress
from shared.tokenizer import NoTokenizer, Tokenizer, TokenizerMissing

T = TypeVar("T")


def error_body(message: str, kind: str, request_id: str | None = None) -> dict:
    detail = {"message": message, "type": kind}
    if request_id is not None:
        detail["request_id"] = request_id
    return {"error": detail}


async def read_body(request: web.Request, schema: type[T]) -> T:
    """The body as its typed, range-checked struct (`schemas.py`), or a 400."""
    return decode_body(await request.read(), schema)


def token_limit(
    request: web.Request,
    sid: str | None,
    new_tokens: int,
    field: str,
    requested: int | None,
    default: int,
) -> int:
    """A request's max_new_tokens (see `output_budget`); a session turn's prompt is the
    session's history plus its new input."""
    history = 0 if sid is None else own_session(request, sid).history.size
    context_len = request.app[FRONT_DOOR].context_len
    return output_budget(history, new_tokens, requested, default, context_len, field)


async def run_generation(
    request: web.Request,
    rid: str,
    tokens: list[int],
    params: SamplingParams,
    sid: object,
    session_params: dict,
    progress: Progress | None = None,
    chat: ChatTurn | None = None,
) -> Request:
    """Run a plain request, or the next turn of the caller's session its client calls
    `sid` (`chat`: a chat turn's conversation), to its end; refused with a 503 while the
    waiting queue is full."""
    check_queue(request)
    if sid is not None:
        sid = own_session(request, sid).sid
    door = request.app[FRONT_DOOR]
    check_text(door.tokenizer, params)
    namespace = cache_namespace_of(request)
    return await door.generate(rid, tokens, params, sid, session_params, progress, chat, namespace)


@dataclass(frozen=True)
class Job:
    """One request of several run at once: an OpenAI choice, a batch item."""

    rid: str
    tokens: list[int]
    params: SamplingParams
    progress: Progress | None = None


async def run_all(request: web.Request, jobs: list[Job]) -> list[Request]:
    """Run plain requests at once, each to its end, in the order of `jobs`. All are
    counted against the queue limit before any is submitted (a 503 refuses the lot), and
    if one fails the others are aborted (their waits are cancelled, which aborts)."""
    check_queue(request, len(jobs))
    door, namespace = request.app[FRONT_DOOR], cache_namespace_of(request)
    for job in jobs:
        check_text(door.tokenizer, job.params)
    try:
        async with asyncio.TaskGroup() as group:
            runs = [
                group.create_task(
                    door.generate(
                        j.rid, j.tokens, j.params, progress=j.progress, cache_namespace=namespace
                    )
                )
                for j in jobs
            ]
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [run.result() for run in runs]


def check_text(tokenizer: Tokenizer, params: SamplingParams) -> None:
    """Stop strings are matched on text: ids-only, they are refused naming the file."""
    if params.stop and isinstance(tokenizer, NoTokenizer):
        missing = tokenizer.missing
        raise TokenizerMissing(f"stop strings need text, but {missing} is missing (ids-only)")


def own_session(request: web.Request, name: object) -> Session:
    """The caller's open session its client calls `name`."""
    return request.app[FRONT_DOOR].session(session_id(request, name))


class EventStream:
    """A reply as server-sent events whose 200 headers go out with the first event: the
    request is submitted (and so checked completely) before that, so every refusal is
    still a plain 4xx. Registered on the request, so a fault after the headers can end
    the stream with an error event (`http_errors.py`)."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        request[EVENT_STREAM] = self
        self._order = asyncio.Lock()  # requests run at once (`run_all`) share one stream

    async def send(self, payload: dict | str) -> None:
        data = payload.encode() if isinstance(payload, str) else msgspec.json.encode(payload)
        async with self._order:
            if not self.response.prepared:
                await self.response.prepare(self.request)
            await self.response.write(b"data: " + data + b"\n\n")


EVENT_STREAM = web.RequestKey("event_stream", EventStream)


def output_text(req: Request) -> str:
    """The whole output text of an ended request (`records/request.py`'s `text`: cut
    before a matched stop string unless no_stop_trim; empty when ids-only)."""
    return "" if req.text is None else req.text.final(req.output)


def prompt_tokens(request: web.Request, text: str, sid: str | None) -> list[int]:
    """A raw text prompt's ids, with the special tokens the tokenizer's post-processor
    adds (a BOS) only where the token sequence starts: never for a session turn after
    the first, whose text continues the history."""
    starts = sid is None or own_session(request, sid).history.size == 0
    return request.app[FRONT_DOOR].tokenizer.encode(text, starts)


@dataclass(frozen=True)
class Chunk:
    """One streamed chunk of a request: its new text, the text so far, and the output
    ids it covers (`output[start:end]`, what per-chunk extras such as logprobs cut)."""

    delta: str
    text: str
    start: int
    end: int


class StreamCursor:
    """What a stream has sent of one request, so each chunk carries only what is new
    and the last one (at the end) the rest: streamed text joined is the final text."""

    def __init__(self) -> None:
        self.chars = self.tokens = 0
        self.ended = False

    def next(self, req: Request) -> Chunk | None:
        """The chunk to send now; None when nothing is new (or the end was sent)."""
        if self.ended:
            return None
        text = "" if req.text is None else req.text.shown(req.output, req.done)
        start, end = self.tokens, len(req.output)
        if len(text) == self.chars and start == end and not req.done:
            return None
        chunk = Chunk(text[self.chars :], text, start, end)
        self.chars, self.tokens, self.ended = len(text), end, req.done
        return chunk
