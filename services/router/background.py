"""Work the router's answer need not wait for (a close's placement removed, a rid kept
for its aborts, a failed open's leftovers released): run as tasks the router keeps
referenced until they end, each failure logged."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("custody.router")


class Background:
    def __init__(self) -> None:
        self.pending: set[asyncio.Future] = set()

    def run(self, work: Coroutine[Any, Any, object]) -> None:
        task = asyncio.ensure_future(work)
        self.pending.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Future) -> None:
        self.pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("router bookkeeping failed: %r", task.exception())
