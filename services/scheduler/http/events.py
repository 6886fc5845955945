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

    def __init__(self, request: web.Request, typed: bool = False) -> None:
        """`typed`: each event named (`event:` lines, the Responses and Messages APIs'
        form)."""
        self.request, self.typed, self.sent = request, typed, 0
        self.response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        request[EVENT_STREAM] = self

    async def send(self, payload: dict | str, event: str | None = None) -> None:
        data = payload.encode() if isinstance(payload, str) else msgspec.json.encode(payload)
        if not self.response.prepared:
            await self.response.prepare(self.request)
        head = b"" if event is None else b"event: " + event.encode() + b"\n"
        await self.response.write(head + b"data: " + data + b"\n\n")
        self.sent += 1

    async def fail(self, error: dict) -> None:
        """End the stream with `error` (`{"error": {...}}`) after its headers went out."""
        if self.typed:  # both APIs' shape: the Responses API's numbered, with its code
            detail = error["error"] | {"code": error["error"]["type"], "param": None}
            await self.send(
                {"type": "error", "sequence_number": self.sent, "error": detail}, "error"
            )
        else:
            await self.send(error)
            await self.send("[DONE]")


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


async def send_typed_events(
    request: web.Request, events: AsyncIterator[tuple[str, dict]], done: bool = False
) -> web.StreamResponse:
    """Stream named `events` (`send_events`' rules), then `[DONE]` if `done` (the
    Responses API ends so; Anthropic's Messages API does not)."""
    sse = EventStream(request, typed=True)
    async with aclosing(events):
        async for name, payload in events:
            await sse.send(payload, name)
    if done:
        await sse.send("[DONE]")
    if not sse.response.prepared:
        await sse.response.prepare(request)
    return sse.response
