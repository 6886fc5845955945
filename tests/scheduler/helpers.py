"""Small helpers shared by the allocator tests."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from services.scheduler.allocators.pools import Pools
from services.scheduler.ownership.errors import InvariantViolation
from services.scheduler.ownership.invariants import Claim, IntegrityReport, check_integrity
from services.scheduler.ownership.ledger import Ledger
from services.scheduler.ownership.owners import Owner


def row_claims(pools: Pools, owner: Owner, row: int, borrowed: int = 0) -> list[Claim]:
    length = int(pools.rows.lens[row])
    return [(owner, "req", [row]), (owner, "kv", pools.rows.row_pages(row, borrowed, length))]


def assert_clean(pools: Pools, claims: list[Claim], *, idle: bool) -> IntegrityReport:
    assert pools.kv.integrity_problems() == []
    return assert_integrity(pools.ledger, claims, idle=idle)


def assert_no_overlap(*groups: np.ndarray) -> None:
    joined = np.concatenate([np.asarray(g).ravel() for g in groups]) if groups else np.array([])
    assert len(np.unique(joined)) == len(joined), f"overlapping indices: {joined.tolist()}"


def assert_page_aligned(tokens: np.ndarray, page_size: int) -> None:
    """Consecutive positions stay on one page until it is full."""
    pages = tokens // page_size
    offsets = tokens % page_size
    for i in range(1, len(tokens)):
        if offsets[i] != 0:
            assert pages[i] == pages[i - 1] and offsets[i] == offsets[i - 1] + 1


def assert_integrity(ledger: Ledger, claims: Iterable[Claim], *, idle: bool) -> IntegrityReport:
    report = check_integrity(ledger, claims, idle=idle)
    if not report.ok:
        raise InvariantViolation("\n".join(report.problems))
    return report
