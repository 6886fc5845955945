"""What an edge worker's handlers call instead of the core's front door: the same reads
(settings, tokenizer, the model's sizes) and the same `follow` and `run`, the turns sent
to the core over the edge link and their requests mirrored here from its news, so the
reply builders (sglang_replies.py, openai_replies.py) run unchanged in the worker.
Anything about sessions is the core's: asking for one raises `InCore`, and the worker
hands the whole HTTP request to the core (worker.py)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import msgspec
import numpy as np

from services.scheduler.edge.messages import (
    STATUSES,
    Close,
    Extra,
    Failure,
    Step,
    Submit,
    ToEdge,
    WireTurn,
    frame,
    read_frame,
)
from services.scheduler.http.errors import Relayed
from services.scheduler.records.request import Request, Status
from services.scheduler.records.session import Session
from services.scheduler.records.turn import Turn
from services.scheduler.runtime.front_door import last_of
from services.scheduler.text.output import OutputText
from shared.config import Settings
from shared.model_config import ModelConfig
from shared.tokenizer import Tokenizer

# A call that never reached the core ran nothing: a retry is safe. One sent to a core
# that then ended may have run (a session's turn may be committed): the client must
# treat it as a call that got no answer, never as a clean refusal.
CORE_GONE = (503, "the scheduling core is not answering; nothing ran; retry", "core_gone")
CORE_LOST = (502, "the scheduling core ended during this request; it may have run", "core_lost")


class InCore(Exception):
    """This request is the core's to serve (it names a session): forward it whole."""


class Call:
    """One call's requests as the worker mirrors them, and what the core said last."""

    def __init__(self, requests: list[Request]) -> None:
        self.requests = requests
        self.news = asyncio.Event()
        self.ended = False
        self.failure: Failure | None = None

    def apply(
        self,
        index: int,
        tokens: list[int],
        logprobs: list[float],
        cached: int,
        status: Status,
        extra: Extra | None,
    ) -> None:
        """One row of a step's news: request `index` of this call has these new."""
        req = self.requests[index]
        req.output += tokens
        req.logprobs += logprobs
        req.cached_tokens = cached
        req.status = status
        req.finish_reason = None if extra is None else extra.finish_reason
        if req.text is not None:
            req.text.stop_at = None if extra is None else extra.stop_at
        if extra is not None:
            req.top_logprobs += extra.top
            if extra.inputs is not None:
                req.scored_from = extra.inputs.scored_from
                req.input_logprobs = extra.inputs.logprobs
                req.input_top = extra.inputs.top
        self.news.set()


class RemoteDoor:
    def __init__(
        self,
        settings: Settings,
        tokenizer: Tokenizer,
        model: ModelConfig,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self._model = model
        self._reader, self._writer = reader, writer
        self._calls: dict[int, Call] = {}
        self._numbers = itertools.count()
        self._decoder = msgspec.msgpack.Decoder(ToEdge)
        self._gone = False  # the core closed the link: no call can be sent

    @property
    def context_len(self) -> int:
        return self.settings.context_len

    @property
    def vocab_size(self) -> int:
        return self._model.vocab_size

    def session(self, sid: str) -> Session:
        raise InCore(sid)

    async def listen(self) -> None:
        """Apply the core's news until it closes the link (then every call still
        waiting fails as lost: the core that had its requests is gone)."""
        try:
            while (body := await read_frame(self._reader)) is not None:
                self._apply(self._decoder.decode(body))
        finally:
            self._gone = True
            for call in self._calls.values():
                call.failure = call.failure or Failure(-1, *CORE_LOST)
                call.news.set()

    def _apply(self, step: Step) -> None:
        extras = {extra.row: extra for extra in step.extras}
        t = lp = 0
        rows = zip(step.calls, step.indexes, step.token_counts, step.logprob_counts, strict=True)
        for row, (number, index, n_tokens, n_logprobs) in enumerate(rows):
            call = self._calls.get(number)
            if call is not None:
                call.apply(
                    index,
                    step.tokens[t : t + n_tokens],
                    step.logprobs[lp : lp + n_logprobs],
                    step.cached[row],
                    STATUSES[step.statuses[row]],
                    extras.get(row),
                )
            t, lp = t + n_tokens, lp + n_logprobs
        for number in step.ended:
            call = self._calls.get(number)
            if call is not None:
                call.ended = True
                call.news.set()
        for failure in step.failed:
            call = self._calls.get(failure.call)
            if call is not None:
                call.failure = failure
                call.news.set()

    async def follow(self, turns: list[Turn]) -> AsyncIterator[list[Request]]:
        """As FrontDoor.follow: the call's requests each time the core's news of any
        arrives, the last time once all ended; closing it early closes the call (the
        core aborts what has not ended)."""
        if self._gone:
            raise Relayed(*CORE_GONE)
        number = next(self._numbers)
        requests = [self._mirror(t) for t in turns]
        call = self._calls[number] = Call(requests)
        wire = [WireTurn(t.rid, t.shown, t.tokens, t.params, t.cache_namespace) for t in turns]
        self._writer.write(frame(Submit(number, turns[0].tenant, wire)))
        try:
            while True:
                await call.news.wait()
                call.news.clear()
                if call.failure is not None:
                    f = call.failure
                    raise Relayed(f.status, f.message, f.kind)
                yield requests
                if call.ended:
                    return
        finally:
            del self._calls[number]
            if not call.ended and call.failure is None and not self._writer.is_closing():
                self._writer.write(frame(Close(number)))

    async def run(self, turns: list[Turn]) -> list[Request]:
        return await last_of(self.follow(turns))

    def _mirror(self, turn: Turn) -> Request:
        req = Request(turn.rid, np.asarray(turn.tokens, dtype=np.int64), turn.params)
        req.text = OutputText(self.tokenizer, turn.params.stop, not turn.params.no_stop_trim)
        return req
