"""Request rows: the `req_to_token` table, stored as a page table per row.

Row r maps position p to KV token index `pages[r, p // page_size] * page_size +
p % page_size`, so page alignment holds by construction. `lens[r]` is how many
positions have KV allocated. The owner of a row is the owner of its slot in the `req`
pool; the owner of each KV page is in the `kv` pool. Neither is stored here.
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

    def owner_ids(self, rows: np.ndarray) -> np.ndarray:
        """Owner id of each row, read from the row pool (the single source)."""
        return self.rows.owner_view[rows]

    def cells(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Indices into `flat` of page-table entries (rows[i], cols[i])."""
        return rows * self.max_pages + cols

    def token_indices(self, row: int, start: int, end: int) -> np.ndarray:
        """KV token indices of positions [start, end) of `row`."""
        pos = np.arange(start, end, dtype=np.int64)
        return self.pages[row, pos // self.page_size] * self.page_size + pos % self.page_size

    def row_pages(self, row: int, start: int, end: int) -> np.ndarray:
        """Pages holding positions [start, end); start must be page-aligned."""
        ps = self.page_size
        return self.pages[row, start // ps : -(-end // ps)].copy()
