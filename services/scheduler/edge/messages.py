"""The link between an edge worker and the scheduling core (docs/edge-workers.md): typed,
length-prefixed msgpack frames over a Unix socket. A worker sends each call's turns
whole and, if its client leaves, a close; the core sends, once per step, one frame with
the news of every request of that worker that changed (as columns), and the calls that
ended."""

from __future__ import annotations

import asyncio
import struct

import msgspec

from services.scheduler.records.finish import FinishReason
from services.scheduler.records.request import Status
from services.scheduler.records.sampling import SamplingParams

MAX_FRAME = 1 << 30  # a frame longer than this is a broken peer, not a message
_LENGTH = struct.Struct(">I")


class WireTurn(msgspec.Struct, frozen=True, array_like=True):
    """A plain turn as a worker decoded it (records/turn.py's, without a session: a
    session's request is served by the core whole)."""

    rid: str  # the server's id
    shown: str  # its client's id (the core holds it for the tenant: 409s, aborts)
    tokens: list[int]
    params: SamplingParams
    cache_namespace: str


class Submit(msgspec.Struct, frozen=True, tag="submit"):
    call: int  # the worker's number for the call
    tenant: str | None
    turns: list[WireTurn]


class Close(msgspec.Struct, frozen=True, tag="close"):
    """The worker's client went away: abort what has not ended."""

    call: int


class Inputs(msgspec.Struct, frozen=True, array_like=True):
    """A request's input log probabilities (Request.score_inputs), sent once they are
    complete: with its first output token, or at its end."""

    scored_from: int
    logprobs: list[float | None]
    top: list[tuple[list[int], list[float]] | None]


class Extra(msgspec.Struct, frozen=True, array_like=True):
    """What only some rows of a step carry: the new tokens' top alternatives (when asked
    for), and at its end a request's finish reason and where a stop string matched; its
    input log probabilities once."""

    row: int  # the row of the step's columns it belongs to
    top: list[tuple[list[int], list[float]]]
    finish_reason: FinishReason | None = None
    stop_at: int | None = None  # where a matched stop string starts in the text
    inputs: Inputs | None = None


class Failure(msgspec.Struct, frozen=True, array_like=True):
    """A call the core refused, or whose turn it refused at the end: the answer as the
    core's errors.classify gives it."""

    call: int
    status: int
    message: str
    kind: str


class Step(msgspec.Struct, frozen=True, tag="step"):
    """The core's news for one worker, once per step, as columns: row i is request
    `indexes[i]` of call `calls[i]`, which has `token_counts[i]` new tokens (the next of
    `tokens`) and `logprob_counts[i]` new log probabilities (the next of `logprobs`), its
    cached tokens and status (an index into STATUSES); a row's `Extra`, if any, is in
    `extras`. One frame decodes into a few lists, not an object per request. Every call
    in `ended` has had its last news (in this frame or before); every call in `failed`
    ends with that answer."""

    calls: list[int]
    indexes: list[int]  # among the call's turns
    token_counts: list[int]
    tokens: list[int]
    logprob_counts: list[int]
    logprobs: list[float]
    cached: list[int]
    statuses: list[int]
    extras: list[Extra]
    ended: list[int]
    failed: list[Failure]


STATUSES = tuple(Status)  # a row's status, by its index here

ToCore = Submit | Close
ToEdge = Step


def frame(message: msgspec.Struct) -> bytes:
    body = msgspec.msgpack.encode(message)
    return _LENGTH.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's body; None once the peer closed the link."""
    try:
        head = await reader.readexactly(_LENGTH.size)
        (size,) = _LENGTH.unpack(head)
        if size > MAX_FRAME:
            raise ValueError(f"a frame of {size} bytes on the edge link")
        return await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
