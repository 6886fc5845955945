"""What a stream has sent of one request, so each chunk carries only what is new, and the
whole output text of an ended one: what every kind of streamed reply cuts its chunks by."""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.records.request import Request


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
