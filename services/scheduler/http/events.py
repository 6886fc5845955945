"""Replies as server-sent events: the stream, and the one function that writes a reply's
chunks to it as its builder (sglang_replies.py, openai_replies.py) pulls them from the
core, then `[DONE]`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

import msgspec
from aiohttp import web


class EventStream:
    """A reply as server-sent events whose 200 headers go out with the first event: the
    request is submitted (and so checked completely) before that, so every refusal is
    still a plain 4xx. Registered on the request, so a fault after the headers can end
    the stream with an error event (`errors.py`)."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        request[EVENT_STREAM] = self

    async def send(self, payload: dict | str) -> None:
        data = payload.encode() if isinstance(payload, str) else msgspec.json.encode(payload)
        if not self.response.prepared:
            await self.response.prepare(self.request)
        await self.response.write(b"data: " + data + b"\n\n")


EVENT_STREAM = web.RequestKey("event_stream", EventStream)


async def send_events(request: web.Request, chunks: AsyncIterator[dict]) -> web.StreamResponse:
    """Stream `chunks` as events, then `[DONE]`. The builder queues its requests when
    first pulled, so a refusal raised then is a plain 4xx (no headers went out); the
    builder is closed however this ends, which aborts what it has not finished."""
    sse = EventStream(request)
    async with aclosing(chunks):
        async for chunk in chunks:
            await sse.send(chunk)
    await sse.send("[DONE]")
    return sse.response
