"""The executor's copy of each request row's page table, so that a step carries only
what changed (shared/messages/forward.py, `StepRow.kv_from`).

A row slot's table is kept for one request (its `rid`). A row with `kv_from` 0 brings
its whole context and replaces the table; a row with `kv_from` k > 0 extends the table
of its row slot, which must be that request's and hold at least k positions: positions
before k are the table's, the rest the row's. Anything else refuses the step naming the
row: a table the executor lacks (a restarted executor, a scheduler that lost track) is
never guessed at, and the scheduler answers a refusal by sending whole tables again.

Tables change only once the whole step has been checked (`commit`), so a refused step
leaves them as they were. Every index entered a table through `resolve`, which checks
each new index against the KV pool's range: an index is checked once, when it arrives,
not on every step that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from services.executor.refusal import BatchRefused
from shared.messages.forward import StepRow


@dataclass(frozen=True)
class RowTable:
    """A request row's KV token indices: `indices[:length]` (the buffer has room to grow
    by appending in place)."""

    rid: str
    indices: np.ndarray
    length: int


Pending = list[tuple[int, RowTable]]  # tables to keep once the step is accepted


class PageTables:
    def __init__(self, lowest: int, limit: int, max_rows: int) -> None:
        """KV indices must lie in [lowest, limit) (below `lowest`: the padding sink);
        row slots in 1..max_rows."""
        self.lowest, self.limit, self.max_rows = lowest, limit, max_rows
        self.tables: dict[int, RowTable] = {}

    def resolve(self, rows: list[StepRow]) -> tuple[list[StepRow], Pending]:
        """Each row with its whole context (`kv_from` 0), and the tables to keep if the
        step is accepted; BatchRefused for a delta no table here supports."""
        self._check_range(rows)
        resolved, pending = [], []
        seen: set[int] = set()
        for row in rows:
            if not row.row:
                resolved.append(row)  # a whole context, kept nowhere (StepRow.__post_init__)
                continue
            if not 0 < row.row <= self.max_rows or row.row in seen:
                raise BatchRefused(f"row {row.rid}: request row {row.row} is out of range or twice")
            seen.add(row.row)
            table = self._extended(row)
            pending.append((row.row, table))
            context = table.indices[: table.length]
            resolved.append(msgspec.structs.replace(row, kv_indices=context, kv_from=0))
        return resolved, pending

    def _check_range(self, rows: list[StepRow]) -> None:
        """Every KV index within the pool, page 0 (the padding sink) excluded: checked over
        the step's indices at once (a decoding row carries one or none), the first row
        outside named."""
        if not rows:
            return
        every = np.concatenate([row.kv_indices for row in rows])
        if not len(every) or (every.min() >= self.lowest and every.max() < self.limit):
            return
        for row in rows:
            new = row.kv_indices
            if len(new) and (int(new.min()) < self.lowest or int(new.max()) >= self.limit):
                raise BatchRefused(
                    f"row {row.rid}: KV indices outside {self.lowest}..{self.limit - 1} "
                    "(page 0 is the padding sink)"
                )

    def commit(self, pending: Pending) -> None:
        for slot, table in pending:
            self.tables[slot] = table

    def _extended(self, row: StepRow) -> RowTable:
        """The table of `row`'s slot once the row's indices are in it."""
        start, end = row.kv_from, row.end
        if start == 0:
            return RowTable(row.rid, _grown(row.kv_indices, end), end)
        held = self.tables.get(row.row)
        if held is None or held.rid != row.rid or held.length < start:
            has = "none" if held is None else f"{held.length} positions of {held.rid}"
            raise BatchRefused(
                f"row {row.rid}: a KV delta from position {start} for request row "
                f"{row.row}, whose table here holds {has}"
            )
        indices = held.indices
        if start < held.length or len(indices) < end:  # never overwrite a kept entry
            indices = _grown(indices[:start], end)
        indices[start:end] = row.kv_indices
        return RowTable(row.rid, indices, end)


def _grown(kept: np.ndarray, end: int) -> np.ndarray:
    """A buffer holding `kept`, with room for `end` positions and as many again: a
    decoding row appends in place, with an amortised O(1) copy per position."""
    buffer = np.empty(max(2 * end, 64), dtype=np.int32)
    buffer[: len(kept)] = kept
    return buffer
