"""The replies of SGLang's /generate, one function per form: `reply` for the whole answer
(one request's, or a batch's list), `chunks` for a stream's events, pulled from the core
as its steps bring tokens (cumulative chunks as SGLang sends them, or only what is new
with `--incremental-streaming-output`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import msgspec

from services.scheduler.http.logprobs import SglangStream, TokenTexts
from services.scheduler.http.logprobs import sglang as sglang_logprobs
from services.scheduler.http.stream_cursor import new_chunks, output_text
from services.scheduler.records.request import Request
from services.scheduler.records.turn import Turn
from services.scheduler.runtime.front_door import FrontDoor


@dataclass(frozen=True)
class Generation:
    """A /generate call decoded and checked (routes.py): its turns, the id its client
    sees for each, and the shape of its replies."""

    turns: list[Turn]
    shown: list[str]  # the client's rid of each turn
    stream: bool
    batch: bool  # a list of replies (a batch, or n > 1); streamed, chunks carry `index`
    logprobs: TokenTexts | None  # None: no logprob fields


def response_of(
    req: Request, rid: str, logprobs: TokenTexts | None = None, text: str | None = None
) -> dict:
    """The SGLang response; `rid` is the client's (the engine's is internal); `logprobs`:
    with the logprob fields, naming their tokens so; `text`: what a stream shows so far
    (default: the whole text of the ended request)."""
    meta = {
        "id": rid,
        "finish_reason": msgspec.to_builtins(req.finish_reason),
        "prompt_tokens": len(req.prompt),
        "completion_tokens": len(req.output),
        "cached_tokens": req.cached_tokens,
    }
    if logprobs is not None:
        meta |= sglang_logprobs(logprobs, req)
    text = output_text(req) if text is None else text
    return {"text": text, "output_ids": list(req.output), "meta_info": meta}


def reply(call: Generation, ended: list[Request]) -> dict | list[dict]:
    """The whole answer: a batch's replies in the order of its turns."""
    replies = [
        response_of(req, rid, call.logprobs) for req, rid in zip(ended, call.shown, strict=True)
    ]
    return replies if call.batch else replies[0]


async def chunks(door: FrontDoor, call: Generation) -> AsyncIterator[dict]:
    """A stream's chunks, each request's as its tokens arrive (after the first, every
    `--stream-interval` tokens): SGLang's are cumulative (text, output ids and logprobs
    so far), or with `--incremental-streaming-output` carry only what is new."""
    incremental = door.settings.incremental_streaming_output
    entries = [
        None if call.logprobs is None else SglangStream(call.logprobs, t.params.top_logprobs > 0)
        for t in call.turns
    ]
    async with aclosing(new_chunks(door, call.turns)) as news:
        async for i, req, chunk in news:
            start = chunk.start if incremental else 0
            text = chunk.delta if incremental else chunk.text
            body = response_of(req, call.shown[i], None, text)
            body["output_ids"] = body["output_ids"][start : chunk.end]
            if entries[i] is not None:
                body["meta_info"] |= entries[i].fields(req, start, chunk.end)
            yield body | {"index": i} if call.batch else body
