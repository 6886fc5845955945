"""The executor's page tables (services/executor/page_tables.py): a delta extends only
the table it was computed against, a refused step leaves every table as it was, and an
index is range-checked when it arrives."""

from __future__ import annotations

import numpy as np
import pytest

from services.executor.page_tables import PageTables
from services.executor.refusal import BatchRefused
from shared.messages.forward import StepRow

PAGE = 4
LIMIT = 400


def row(rid: str, start: int, kv: list[int], *, kv_from: int = 0, slot: int = 1) -> StepRow:
    tokens = [1] * (len(kv) - start + kv_from)
    return StepRow.of(tokens, start, kv, 1, rid=rid, kv_from=kv_from, row=slot)


def accepted(tables: PageTables, rows: list[StepRow]) -> list[list[int]]:
    resolved, pending = tables.resolve(rows)
    tables.commit(pending)
    return [r.kv_indices.tolist() for r in resolved]


def test_a_delta_extends_the_table_to_the_whole_context():
    tables = PageTables(PAGE, LIMIT, max_rows=8)
    assert accepted(tables, [row("a", 0, [4, 5, 6])]) == [[4, 5, 6]]
    for position in range(3, 200):  # decoding: one index a step, appended in place
        (context,) = accepted(tables, [row("a", position, [position + 4], kv_from=position)])
    assert context == list(range(4, 204))
    # a delta from below the table's end replaces the entries from there on
    (context,) = accepted(tables, [row("a", 200, [40, 41, 99], kv_from=198)])
    assert context == [*range(4, 202), 40, 41, 99]


@pytest.mark.parametrize(
    "case, reason",
    [
        ("no table", "whose table here holds none"),
        ("another request's table", "holds 3 positions of a"),
        ("past the table's end", "holds 3 positions of a"),
        ("the sink page", "outside 4..399"),
        ("beyond the pool", "outside 4..399"),
        ("row out of range", "out of range or twice"),
    ],
)
def test_a_delta_without_its_table_is_refused_and_changes_nothing(case, reason):
    tables = PageTables(PAGE, LIMIT, max_rows=8)
    accepted(tables, [row("a", 0, [4, 5, 6])])
    bad = {
        "no table": row("a", 3, [7], kv_from=3, slot=2),
        "another request's table": row("b", 3, [7], kv_from=3),
        "past the table's end": row("a", 4, [8], kv_from=4),
        "the sink page": row("a", 3, [1], kv_from=3),
        "beyond the pool": row("a", 3, [LIMIT], kv_from=3),
        "row out of range": row("a", 0, [4], slot=9),
    }[case]
    good = row("c", 0, [20, 21], slot=3)
    with pytest.raises(BatchRefused, match=reason):
        tables.resolve([good, bad])
    assert set(tables.tables) == {1}  # the good row of the refused step was not kept
    (context,) = accepted(tables, [row("a", 3, [7], kv_from=3)])
    assert context == [4, 5, 6, 7]


def test_a_refused_step_leaves_an_appended_table_as_it_was():
    """The delta was written past the table's end in place; refused, the table still
    ends where it did, and the scheduler's whole table replaces it."""
    tables = PageTables(PAGE, LIMIT, max_rows=8)
    accepted(tables, [row("a", 0, [4, 5, 6])])
    with pytest.raises(BatchRefused):
        tables.resolve([row("a", 3, [7], kv_from=3), row("b", 0, [0], slot=2)])
    assert tables.tables[1].length == 3
    assert accepted(tables, [row("a", 0, [9, 10, 11, 12])]) == [[9, 10, 11, 12]]


def test_a_row_of_no_request_row_is_kept_nowhere():
    tables = PageTables(PAGE, LIMIT, max_rows=8)
    whole = StepRow.of([1, 1], 0, np.array([4, 5]), 1)
    assert accepted(tables, [whole, whole]) == [[4, 5], [4, 5]] and not tables.tables
