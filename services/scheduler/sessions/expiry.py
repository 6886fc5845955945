"""When idle sessions time out, without scanning them: a heap of deadlines holding at
most one entry per session. A session used again only moves its deadline in a table
(`_deadline`); its entry, when it comes due, is put back at the deadline it has now, so a
chatty session costs one entry, not one per turn (an entry per use kept ~248 B per turn
alive until the client-chosen timeout, up to 7 days). A closed session's entry is
dropped when it comes due, or when closed entries reach half the heap, which is then
rebuilt from the table: O(1) amortized. Each expiry pass costs O(log n) per due entry and
nothing for the sessions not yet due."""

from __future__ import annotations

import heapq
from collections.abc import Iterator


class Deadlines:
    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []  # (deadline it was queued at, sid)
        self._deadline: dict[str, float] = {}  # each session's deadline now
        self._queued: set[str] = set()  # sessions with an entry in the heap
        self.visits = 0  # entries looked at by `due`: its cost, for tests

    def __len__(self) -> int:
        return len(self._heap)

    def set(self, sid: str, deadline: float) -> None:
        """`sid` now times out at `deadline`, no earlier than it did (a session's
        timeout is fixed, and each use sets now + timeout)."""
        self._deadline[sid] = deadline
        if sid not in self._queued:
            self._queued.add(sid)
            heapq.heappush(self._heap, (deadline, sid))

    def drop(self, sid: str) -> None:
        """`sid` is gone: it never comes due."""
        self._deadline.pop(sid, None)
        if len(self._heap) > 2 * len(self._deadline) + 64:
            self._heap = [(d, s) for s, d in self._deadline.items() if s in self._queued]
            heapq.heapify(self._heap)
            self._queued = {s for _, s in self._heap}

    def due(self, now: float) -> Iterator[tuple[str, float]]:
        """(sid, deadline) of every session due at `now`, its entry taken off the heap
        (the caller sets a new deadline if it keeps the session)."""
        while self._heap and self._heap[0][0] <= now:
            _, sid = heapq.heappop(self._heap)
            self.visits += 1
            deadline = self._deadline.get(sid)
            if deadline is None:
                self._queued.discard(sid)
                continue
            if deadline > now:  # used since it was queued: back at its deadline now
                heapq.heappush(self._heap, (deadline, sid))
                continue
            self._queued.discard(sid)
            yield sid, deadline
