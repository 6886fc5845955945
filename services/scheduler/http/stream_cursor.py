"""What a stream has sent of one request, so each chunk carries only what is new, and the
whole output text of an ended one: what every kind of streamed reply cuts its chunks by,
pulled from the core (`new_chunks`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from services.scheduler.records.request import Request
from services.scheduler.records.turn import Turn
from services.scheduler.runtime.front_door import FrontDoor


def output_text(req: Request) -> str:
    """The whole output text of an ended request (`records/request.py`'s `text`: cut
    before a matched stop string unless no_stop_trim; empty when ids-only)."""
    return "" if req.text is None else req.text.final(req.output)


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
    and the last one (at the end) the rest: streamed text joined is the final text.

    `interval` (`--stream-interval`, SGLang's flag): after the first token, which goes
    at once, a chunk waits until that many tokens are unsent, or the end. Every kind of
    stream cuts its chunks here, so each keeps its shape, only with fewer chunks."""

    def __init__(self, interval: int = 1) -> None:
        self.interval = interval
        self.chars = self.tokens = 0
        self.ended = False

    def next(self, req: Request) -> Chunk | None:
        """The chunk to send now; None when nothing is new (or the end was sent)."""
        if self.ended:
            return None
        if not req.done and self.tokens and len(req.output) - self.tokens < self.interval:
            return None
        text = "" if req.text is None else req.text.shown(req.output, req.done)
        start, end = self.tokens, len(req.output)
        if len(text) == self.chars and start == end and not req.done:
            return None
        chunk = Chunk(text[self.chars :], text, start, end)
        self.chars, self.tokens, self.ended = len(text), end, req.done
        return chunk


News = tuple[int, Request, Chunk]  # a request's index among its call's, itself, its chunk


async def new_chunks(door: FrontDoor, turns: list[Turn]) -> AsyncIterator[News]:
    """What is new of each of `turns`' requests as the core's steps bring it (each its own
    cursor, `--stream-interval`), with its index among them; the last of each at its end.
    Closing it early aborts those not ended (FrontDoor.follow)."""
    cursors = [StreamCursor(door.settings.stream_interval) for _ in turns]
    async with aclosing(door.follow(turns)) as updates:
        async for requests in updates:
            for i, req in enumerate(requests):
                chunk = cursors[i].next(req)
                if chunk is not None:
                    yield i, req, chunk
