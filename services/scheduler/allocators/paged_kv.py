"""Paged KV token allocation over request rows.

Pages come from the `kv` pool (page 0 is the padding sink) and go to the owner of the
row they extend, read from the `req` pool. Whole steps are batched: every row of a
prefill batch, or every row of a decode batch, in one pool transfer and a handful of
vectorised numpy operations. A row continues its partly filled last page before taking
new pages, and a tail is freed from the first page boundary at or after its start, so a
partial page never leaves its owner.
"""

from __future__ import annotations

import numpy as np

from services.scheduler.allocators.request_rows import RowTable
from services.scheduler.ownership.errors import OwnershipError
from services.scheduler.ownership.slot_pool import SlotPool


def pages_for(lens: np.ndarray | int, page_size: int) -> np.ndarray | int:
    return -(-lens // page_size)


class PagedKV:
    def __init__(self, pages: SlotPool, table: RowTable) -> None:
        self.pool = pages
        self.table = table
        self.page_size = table.page_size
        # How many rows reference each page. Derivable from the row table (and rechecked
        # against it by `integrity_problems`); kept so the pool can refuse, at the moment
        # it happens, to free a page a row still uses (a tail freed without alignment).
        self.refs = np.zeros(pages.capacity + 1, dtype=np.int64)
        pages.set_free_guard(self._refuse_referenced)
        # A power-of-two page size splits a position into page and offset with a shift
        # and a mask: two numpy calls on the decode step instead of three.
        ps = self.page_size
        self._shift = ps.bit_length() - 1 if ps & (ps - 1) == 0 else None

    def extend(self, rows: np.ndarray, new_lens: np.ndarray) -> np.ndarray:
        """Grow each row to `new_lens`; all rows or none. Returns the token indices of the
        new positions, row after row."""
        table, ps = self.table, self.page_size
        old = table.lens[rows]
        if np.any(new_lens < old) or np.any(new_lens > table.max_context):
            raise ValueError(
                f"extend: new lengths must lie in [current, {table.max_context}]: "
                f"rows {rows.tolist()} from {old.tolist()} to {new_lens.tolist()}"
            )
        old_pages = pages_for(old, ps)
        need = pages_for(new_lens, ps) - old_pages
        total = int(need.sum())
        if total:
            pages = self.pool.alloc(total, np.repeat(table.owner_ids(rows), need), "extend")
            starts = np.cumsum(need) - need
            cols = np.arange(total) - np.repeat(starts - old_pages, need)
            table.pages[np.repeat(rows, need), cols] = pages
            self.refs[pages] += 1
        table.lens[rows] = new_lens
        ext = new_lens - old
        n_tok = int(ext.sum())
        tok_rows = np.repeat(rows, ext)
        pos = np.arange(n_tok) - np.repeat(np.cumsum(ext) - ext - old, ext)
        col = pos // ps
        return table.flat[table.cells(tok_rows, col)] * ps + (pos - col * ps)

    def decode(self, rows: np.ndarray) -> np.ndarray:
        """Grow each row by one position; a new page only where the last one is full."""
        table, ps, shift = self.table, self.page_size, self._shift
        old = table.lens[rows]
        # the ufunc's own reduce: ndarray.max goes through numpy's Python wrapper
        if len(old) and np.maximum.reduce(old) >= table.max_context:
            full = rows[old >= table.max_context]
            raise ValueError(f"decode: rows {full.tolist()} are at max_context {table.max_context}")
        if shift is None:
            col = old // ps
            offset = old - col * ps
        else:
            col, offset = old >> shift, old & (ps - 1)
        cells = table.cells(rows, col)
        fresh = offset == 0
        grow = cells[fresh]
        if len(grow):
            pages = self.pool.alloc(len(grow), table.owner_ids(rows[fresh]), "decode")
            table.flat[grow] = pages
            self.refs[pages] += 1
        table.lens[rows] = old + 1
        return table.flat[cells] * ps + offset

    def free_tail(self, row: int, start: int, reason: str = "free_tail") -> None:
        """Drop positions [start, len) of `row`: whole pages from the first page boundary
        at or after `start` go back to the free list; a partial page stays with the row."""
        table, ps = self.table, self.page_size
        length = int(table.lens[row])
        if not 0 <= start <= length:
            raise ValueError(f"free_tail: start {start} outside [0, {length}] of row {row}")
        first, end = pages_for(start, ps), pages_for(length, ps)
        if end > first:
            giver = int(table.rows.owner_of(row))
            pages = table.pages[row, first:end].copy()
            self.refs[pages] -= 1
            table.pages[row, first:end] = 0
            try:
                self.pool.free(pages, giver, reason)
            except OwnershipError as err:
                self.refs[pages] += 1
                table.pages[row, first:end] = pages
                raise OwnershipError(f"row {row}: {err}") from err
        table.lens[row] = start
        table.changed(row, start)

    def borrow(self, row: int, pages: np.ndarray) -> None:
        """Start an empty row on pages someone else owns (a matched cache prefix)."""
        table = self.table
        if table.lens[row]:
            raise ValueError(f"borrow: row {row} is not empty ({table.lens[row]} positions)")
        table.pages[row, : len(pages)] = pages
        self.refs[pages] += 1
        table.lens[row] = len(pages) * self.page_size
        table.changed(row, 0)

    def adopt_prefix(self, row: int, tree_pages: np.ndarray, reason: str = "dedup") -> None:
        """After the row's prefix was inserted into the cache: use the cache's pages for
        it, and free the row owner's own pages where the cache already held that KV."""
        n = len(tree_pages)
        current = self.table.pages[row, :n]
        differ = current != tree_pages
        own = current[differ].copy()
        if len(own) == 0:
            return
        self.refs[own] -= 1
        self.refs[tree_pages[differ]] += 1
        current[differ] = tree_pages[differ]
        self.table.changed(row, int(np.argmax(differ)) * self.page_size)
        self.pool.free(own, int(self.table.rows.owner_of(row)), reason)

    def restore_row(self, row: int, pages: np.ndarray, length: int) -> None:
        """Point an empty row at pages its owner already holds (a rebuilt session)."""
        if self.table.lens[row] or len(pages) != pages_for(length, self.page_size):
            raise ValueError(f"restore_row: row {row} with {len(pages)} pages for {length}")
        self.table.pages[row, : len(pages)] = pages
        self.refs[pages] += 1
        self.table.lens[row] = length
        self.table.changed(row, 0)

    def forget(self, row: int) -> None:
        """Drop an emptied row's references to pages it borrowed; it must own none."""
        table, ps = self.table, self.page_size
        pages = table.pages[row, : pages_for(int(table.lens[row]), ps)]
        own = pages[self.pool.owner_view[pages] == table.rows.owner_of(row)]
        if len(own):
            raise self.pool.ledger.fault(self.pool, own, f"row {row} forgotten while owning pages")
        self.refs[pages] -= 1
        table.pages[row, :] = 0
        table.lens[row] = 0
        table.changed(row, 0)

    def _refuse_referenced(self, pages: np.ndarray) -> None:
        used = pages[self.refs[pages] > 0]
        if len(used):
            raise self.pool.ledger.fault(self.pool, used, "free of pages a row still uses")

    def integrity_problems(self) -> list[str]:
        """Recount page references from the row table and compare with `refs`."""
        table, ps = self.table, self.page_size
        counts = np.zeros_like(self.refs)
        for row in np.flatnonzero(table.rows.owner_view[1:]) + 1:
            np.add.at(counts, table.pages[row, : pages_for(int(table.lens[row]), ps)], 1)
        bad = np.flatnonzero(counts[1:] != self.refs[1:]) + 1
        if len(bad) == 0:
            return []
        return [
            f"pool kv: pages {bad.tolist()} are referenced by {counts[bad].tolist()} rows, "
            f"recorded {self.refs[bad].tolist()}"
        ]
