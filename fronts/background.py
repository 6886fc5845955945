"""Work a front's answer need not wait for (a close's placement removed, a rid kept
for its aborts, a failed open's leftovers released): run as tasks the router keeps
referenced until they end. Each is a step safe to repeat, retried while Redis is away or
refuses it (OOM, READONLY): given up after a first fault, a close's placement would stay
in the directory for good, naming a session no replica holds."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from prometheus_client import Counter

from shared.retry import DEPENDENCY_FAULTS, Retry

log = logging.getLogger("custody.router")
PATIENCE_SECONDS = 300.0  # how long one piece of bookkeeping is retried


class Background:
    def __init__(self, faults: Counter | None = None) -> None:
        self.pending: set[asyncio.Future] = set()
        self.retry = Retry("router_bookkeeping", log, faults)

    def run(self, work: Callable[[], Awaitable[object]]) -> None:
        """Run `work()` (again, after each dependency fault) until it succeeds."""
        task = asyncio.ensure_future(self._until_done(work))
        self.pending.add(task)
        task.add_done_callback(self._ended)

    async def _until_done(self, work: Callable[[], Awaitable[object]]) -> None:
        deadline = time.monotonic() + PATIENCE_SECONDS
        while True:
            try:
                await work()
                return
            except DEPENDENCY_FAULTS as err:
                if time.monotonic() > deadline:
                    raise
                await self.retry.wait(err)

    def _ended(self, task: asyncio.Future) -> None:
        self.pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("router bookkeeping failed: %r", task.exception())
