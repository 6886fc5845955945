"""When idle sessions time out, without scanning them: a heap of deadlines holding one
entry per time a session was used. An entry that is no longer its session's deadline
(used since) is dropped when it comes due, so each expiry pass costs O(log n) per due
entry and nothing for the sessions not yet due."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator


class Deadlines:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []  # (deadline, order, sid)
        self._order = itertools.count()
        self.visits = 0  # entries looked at by `due`: its cost, for tests

    def push(self, sid: str, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, next(self._order), sid))

    def due(self, now: float) -> Iterator[tuple[str, float]]:
        """(sid, deadline) of every entry due at `now`, each taken off the heap; the
        caller decides whether the deadline is still the session's."""
        while self._heap and self._heap[0][0] <= now:
            deadline, _, sid = heapq.heappop(self._heap)
            self.visits += 1
            yield sid, deadline
