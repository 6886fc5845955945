"""The scheduling core's end of the edge link: it runs each call a worker sends through
the front door, as an in-process handler would (the same checks, queue and end), holds
its rids for the caller's key (tenancy.py: 409s and aborts are decided here, across
workers), and sends each worker, once per step, one frame with what its requests have
new. Nothing a worker sends can crash the core: a frame that does not decode closes
that worker's link, which aborts its calls."""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from pathlib import Path

import msgspec

from services.scheduler.edge.messages import (
    Close,
    Failure,
    Inputs,
    News,
    Step,
    Submit,
    ToCore,
    frame,
    read_frame,
)
from services.scheduler.http.errors import classify
from services.scheduler.http.tenancy import Tenancy
from services.scheduler.records.request import Request
from services.scheduler.records.turn import Turn
from services.scheduler.runtime.front_door import FrontDoor

log = logging.getLogger("custody.scheduler.edge")

# a worker that lets this much of its news pile up unread is wedged: its link is closed
MAX_UNREAD_BYTES = 64 << 20


class Sent:
    """How much of one request a worker has been sent."""

    __slots__ = ("ended", "logprobs", "tokens", "top")

    def __init__(self) -> None:
        self.tokens = self.logprobs = self.top = 0
        self.ended = False

    def news(self, call: int, index: int, req: Request) -> News | None:
        """What `req` has new since the last news; None if nothing."""
        if self.ended or (len(req.output) == self.tokens and not req.done):
            return None
        inputs = None
        if self.tokens == 0 and req.scored_from >= 0:  # complete once it samples
            top = [None if t is None else (list(t[0]), list(t[1])) for t in req.input_top]
            inputs = Inputs(req.scored_from, list(req.input_logprobs), top)
        news = News(
            call,
            index,
            req.output[self.tokens :],
            req.logprobs[self.logprobs :],
            req.top_logprobs[self.top :],  # lists already (Request.record)
            req.cached_tokens,
            req.status.value,
            req.finish_reason,
            None if req.text is None else req.text.stop_at,
            inputs,
        )
        self.tokens, self.logprobs, self.top = (
            len(req.output),
            len(req.logprobs),
            len(req.top_logprobs),
        )
        self.ended = req.done
        return news


class Outgoing:
    """One worker's news of this step, sent as one frame when the step's wake-ups have
    run (`call_soon` after the first)."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.news: list[News] = []
        self.ended: list[int] = []
        self.failed: list[Failure] = []
        self._queued = False

    def _flush_soon(self) -> None:
        if not self._queued:
            self._queued = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._queued = False
        step = Step(self.news, self.ended, self.failed)
        self.news, self.ended, self.failed = [], [], []
        if self.writer.is_closing():
            return
        if self.writer.transport.get_write_buffer_size() > MAX_UNREAD_BYTES:
            log.warning("an edge worker stopped reading its news: its link is closed")
            self.writer.close()
            return
        self.writer.write(frame(step))

    def add(self, news: list[News]) -> None:
        if news:
            self.news += news
            self._flush_soon()

    def end(self, call: int) -> None:
        self.ended.append(call)
        self._flush_soon()

    def fail(self, call: int, err: Exception) -> None:
        status, message, kind = classify(err)
        if status == 500:
            log.error("an edge worker's call failed", exc_info=err)
        self.failed.append(Failure(call, status, message, kind))
        self._flush_soon()


class EdgeLink:
    """The core's server for its edge workers' links."""

    def __init__(self, door: FrontDoor, tenancy: Tenancy) -> None:
        self.door = door
        self.tenancy = tenancy
        self._decoder = msgspec.msgpack.Decoder(ToCore)
        self.server: asyncio.Server | None = None

    async def serve(self, path: Path) -> None:
        self.server = await asyncio.start_unix_server(self._connection, path)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        out, calls = Outgoing(writer), dict[int, asyncio.Task]()
        try:
            while (body := await read_frame(reader)) is not None:
                message = self._decoder.decode(body)
                if isinstance(message, Submit) and message.call not in calls:
                    task = asyncio.create_task(self._run(out, message))
                    task.add_done_callback(lambda _, call=message.call: calls.pop(call, None))
                    calls[message.call] = task
                elif isinstance(message, Close) and message.call in calls:
                    calls[message.call].cancel()
        except (msgspec.DecodeError, ValueError) as err:
            log.warning("an edge worker sent a frame that does not decode (%s): closing", err)
        finally:
            for task in list(calls.values()):
                task.cancel()  # each aborts what it had not finished (Intake.follow)
            writer.close()

    async def _run(self, out: Outgoing, submit: Submit) -> None:
        """One call: its rids held for its key, its turns through the front door, its
        news after each step that brought any."""
        held = []
        try:
            for t in submit.turns:
                held.append(self.tenancy.hold(submit.tenant, t.shown, t.rid))
            turns = [
                Turn(
                    rid=t.rid,
                    shown=t.shown,
                    tenant=submit.tenant,
                    tokens=t.tokens,
                    params=t.params,
                    cache_namespace=t.cache_namespace,
                )
                for t in submit.turns
            ]
            sent = [Sent() for _ in turns]
            async with aclosing(self.door.follow(turns)) as updates:
                async for requests in updates:
                    out.add(
                        [
                            news
                            for i, req in enumerate(requests)
                            if (news := sent[i].news(submit.call, i, req)) is not None
                        ]
                    )
            out.end(submit.call)
        except Exception as err:
            out.fail(submit.call, err)
        finally:
            self.tenancy.drop(held)
