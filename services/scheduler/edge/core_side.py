"""The scheduling core's end of the edge link: it queues each call a worker sends through
the front door, as an in-process handler would (the same checks, queue and end), holds
its rids for the caller's key (tenancy.py: 409s and aborts are decided here, across
workers), and sends each worker, once per step, one frame with what its requests have
new. Nothing a worker sends can crash the core: a frame that does not decode closes
that worker's link, which aborts its calls."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import msgspec

from services.scheduler.edge.messages import (
    STATUSES,
    Close,
    Extra,
    Failure,
    Inputs,
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
from services.scheduler.runtime.metrics import SchedulerMetrics

log = logging.getLogger("custody.scheduler.edge")

# a worker that lets this much of its news pile up unread is wedged: its link is closed
MAX_UNREAD_BYTES = 64 << 20


STATUS_CODES = {status: code for code, status in enumerate(STATUSES)}


def new_step() -> Step:
    """An empty frame, its columns filled as a step's news is gathered."""
    return Step([], [], [], [], [], [], [], [], [], [], [])


class Sent:
    """How much of one request a worker has been sent."""

    __slots__ = ("ended", "logprobs", "tokens", "top")

    def __init__(self) -> None:
        self.tokens = self.logprobs = self.top = 0
        self.ended = False

    def gather(self, out: Step, call: int, index: int, req: Request) -> None:
        """What `req` has new since the last news, as a row of `out` (none if nothing).
        Everything is read before the row is added, so a fault leaves no half a row."""
        output, logprobs = req.output, req.logprobs
        if self.ended or (len(output) == self.tokens and not req.done):
            return
        inputs = None
        if self.tokens == 0 and req.scored_from >= 0:  # complete once it samples
            top = [None if t is None else (list(t[0]), list(t[1])) for t in req.input_top]
            inputs = Inputs(req.scored_from, list(req.input_logprobs), top)
        stop_at = None if req.text is None else req.text.stop_at
        top = req.top_logprobs[self.top :]  # lists already (Request.record)
        extra = None
        if top or inputs is not None or req.finish_reason is not None or stop_at is not None:
            extra = Extra(len(out.calls), top, req.finish_reason, stop_at, inputs)
        status = STATUS_CODES[req.status]
        out.calls.append(call)
        out.indexes.append(index)
        out.token_counts.append(len(output) - self.tokens)
        out.tokens.extend(output[self.tokens :])
        out.logprob_counts.append(len(logprobs) - self.logprobs)
        out.logprobs.extend(logprobs[self.logprobs :])
        out.cached.append(req.cached_tokens)
        out.statuses.append(status)
        if extra is not None:
            out.extras.append(extra)
        self.tokens, self.logprobs, self.top = len(output), len(logprobs), len(req.top_logprobs)
        self.ended = req.done


class EdgeCall:
    """One worker's call, queued in the core: its requests, their rids held for its key,
    and how much of each the worker has been sent."""

    __slots__ = ("held", "number", "requests", "sent")

    def __init__(self, number: int, requests: list[Request], held: list) -> None:
        self.number, self.requests, self.held = number, requests, held
        self.sent = [Sent() for _ in requests]

    def gather(self, out: Step) -> None:
        for i, req in enumerate(self.requests):
            self.sent[i].gather(out, self.number, i, req)


class WorkerLink:
    """One edge worker's link, in the core: its calls, and their news sent as one frame
    per step. A call costs a task only while it is queued (a grammar check or a session's
    stale move may wait); once queued, the front door calls back when a step brings news
    of it, and one callback (`call_soon` after the step's first) builds the whole frame."""

    def __init__(
        self,
        door: FrontDoor,
        tenancy: Tenancy,
        metrics: SchedulerMetrics,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.door, self.tenancy, self.metrics, self.writer = door, tenancy, metrics, writer
        self.queuing: dict[int, asyncio.Task] = {}
        self.calls: dict[int, EdgeCall] = {}
        self.touched: dict[int, EdgeCall] = {}  # calls a step brought news of
        self.news = new_step()  # this step's, being gathered
        self._queued = False

    def submit(self, submit: Submit) -> None:
        if submit.call in self.queuing or submit.call in self.calls:
            return  # a number already in use: the worker's bug, not the core's
        task = asyncio.create_task(self._queue(submit))
        task.add_done_callback(lambda _: self.queuing.pop(submit.call, None))
        self.queuing[submit.call] = task

    async def _queue(self, submit: Submit) -> None:
        """Hold the call's rids for its key and queue its turns through the front door,
        as an in-process handler's call is."""
        held: list = []
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
            requests = await self.door.queue(turns)
        except Exception as err:
            self.tenancy.drop(held)
            self._fail(submit.call, err)
            return
        except BaseException:
            self.tenancy.drop(held)
            raise
        call = self.calls[submit.call] = EdgeCall(submit.call, requests, held)
        self.metrics.edge_calls.inc()
        self.door.watch(requests, lambda: self._touch(call))
        self._touch(call)  # what is already true of it (a request may have ended at once)

    def close(self, number: int) -> None:
        """The worker's client left: abort what the call has not finished."""
        if number in self.queuing:
            self.queuing[number].cancel()
        elif number in self.calls:
            self._end(self.calls[number])

    def close_all(self) -> None:
        for task in list(self.queuing.values()):
            task.cancel()
        for call in list(self.calls.values()):
            self._end(call)

    def _end(self, call: EdgeCall) -> None:
        del self.calls[call.number]
        self.metrics.edge_calls.dec()
        self.touched.pop(call.number, None)
        self.door.release(call.requests)  # aborts any not ended
        self.tenancy.drop(call.held)

    def _touch(self, call: EdgeCall) -> None:
        self.touched[call.number] = call
        self._flush_soon()

    def _flush_soon(self) -> None:
        if not self._queued:
            self._queued = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._queued = False
        touched, self.touched = self.touched, {}
        for call in touched.values():
            try:
                call.gather(self.news)
                settled = self.door.settled(call.requests)
            except Exception as err:  # a refused turn (SessionError), or a bug here
                self._fail(call.number, err)
                settled = True
            else:
                if settled:
                    self.news.ended.append(call.number)
            if settled:
                self._end(call)
        step, self.news = self.news, new_step()
        if self.writer.is_closing():
            return
        if self.writer.transport.get_write_buffer_size() > MAX_UNREAD_BYTES:
            log.warning("an edge worker stopped reading its news: its link is closed")
            self.metrics.edge_links_closed.labels("unread").inc()
            self.writer.close()
            return
        self.writer.write(frame(step))

    def _fail(self, call: int, err: Exception) -> None:
        status, message, kind = classify(err)
        if status == 500:
            log.error("an edge worker's call failed", exc_info=err)
        self.news.failed.append(Failure(call, status, message, kind))
        self._flush_soon()


class EdgeLink:
    """The core's server for its edge workers' links."""

    def __init__(self, door: FrontDoor, tenancy: Tenancy, metrics: SchedulerMetrics) -> None:
        self.door = door
        self.tenancy = tenancy
        self.metrics = metrics
        self._decoder = msgspec.msgpack.Decoder(ToCore)
        self.server: asyncio.Server | None = None

    async def serve(self, path: Path) -> None:
        self.server = await asyncio.start_unix_server(self._connection, path)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = WorkerLink(self.door, self.tenancy, self.metrics, writer)
        try:
            while (body := await read_frame(reader)) is not None:
                message = self._decoder.decode(body)
                if isinstance(message, Submit):
                    link.submit(message)
                elif isinstance(message, Close):
                    link.close(message.call)
        except (msgspec.DecodeError, ValueError) as err:
            log.warning("an edge worker sent a frame that does not decode (%s): closing", err)
            self.metrics.edge_links_closed.labels("bad_frame").inc()
        finally:
            link.close_all()  # each call aborts what it had not finished
            writer.close()
