"""Request rows: the `req_to_token` table, stored as a page table per row.

Row r maps position p to KV token index `pages[r, p // page_size] * page_size +
p % page_size`, so page alignment holds by construction. `lens[r]` is how many
positions have KV allocated. The owner of a row is the owner of its slot in the `req`
pool; the owner of each KV page is in the `kv` pool. Neither is stored here.

The table also knows what the executor's copy of each row holds (its page tables,
services/executor/page_tables.py): `synced[r]` positions as sent for request
`synced_rid[r]`. A step row then carries only the positions from there on (`delta`).
Whoever changes an entry below that point lowers it (`changed`); whoever cannot know
what the executor holds (a refused step, a lost executor) forgets it all (`unsync`).
"""

from __future__ import annotations

import numpy as np

from services.scheduler.ownership.slot_pool import SlotPool


class RowTable:
    def __init__(self, rows: SlotPool, page_size: int, max_context: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.rows = rows
        self.page_size = page_size
        self.max_context = max_context
        self.max_pages = -(-max_context // page_size)
        self.pages = np.zeros((rows.capacity + 1, self.max_pages), dtype=np.int64)
        self.flat = self.pages.reshape(-1)  # same memory; 1-D gathers are the fast path
        self.lens = np.zeros(rows.capacity + 1, dtype=np.int64)
        self.synced = np.zeros(rows.capacity + 1, dtype=np.int64)
        self.synced_rid = [""] * (rows.capacity + 1)

    def owner_ids(self, rows: np.ndarray) -> np.ndarray:
        """Owner id of each row, read from the row pool (the single source)."""
        return self.rows.owner_view[rows]

    def cells(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Indices into `flat` of page-table entries (rows[i], cols[i])."""
        return rows * self.max_pages + cols

    def token_indices(self, row: int, start: int, end: int) -> np.ndarray:
        """KV token indices of positions [start, end) of `row`."""
        if end - start == 1:  # a decoding row's delta, every step: no arange
            page, offset = divmod(start, self.page_size)
            return np.array([self.pages[row, page] * self.page_size + offset])
        pos = np.arange(start, end, dtype=np.int64)
        return self.pages[row, pos // self.page_size] * self.page_size + pos % self.page_size

    def delta(self, row: int, rid: str, start: int, end: int) -> tuple[int, np.ndarray]:
        """For a step row of request `rid` writing positions [start, end): the first
        position whose KV index it must carry (at most `start`) and the indices from
        there to `end`. The executor holds them all once that row ran."""
        kv_from = min(int(self.synced[row]), start) if self.synced_rid[row] == rid else 0
        self.synced[row], self.synced_rid[row] = end, rid
        return kv_from, self.token_indices(row, kv_from, end)

    def changed(self, row: int, position: int) -> None:
        """Entries of `row` from `position` on changed: send them again."""
        self.synced[row] = min(int(self.synced[row]), position)

    def unsync(self) -> None:
        """What the executor holds is unknown: every row sends its whole context next."""
        self.synced[:] = 0

    def row_pages(self, row: int, start: int, end: int) -> np.ndarray:
        """Pages holding positions [start, end); start must be page-aligned."""
        ps = self.page_size
        return self.pages[row, start // ps : -(-end // ps)].copy()
