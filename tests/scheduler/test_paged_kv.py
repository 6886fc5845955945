"""Paged KV allocation: extend, decode, tail frees, page alignment, batching."""

import numpy as np
import pytest

from services.scheduler.allocators.pools import PoolConfig, Pools
from services.scheduler.ownership.errors import OwnershipError, PoolExhausted
from services.scheduler.ownership.owners import OwnerKind
from tests.scheduler.helpers import assert_clean, assert_no_overlap, assert_page_aligned, row_claims


def make(page_size: int, pages: int = 64, rows: int = 8, context: int = 256) -> Pools:
    return Pools(
        PoolConfig(
            kv_pages=pages,
            page_size=page_size,
            mamba_slots=8,
            max_running_requests=rows,
            max_context=context,
        )
    )


def new_row(pools: Pools, name: str):
    owner = pools.ledger.new_owner(OwnerKind.REQUEST, name)
    return owner, pools.req.alloc_one(owner)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_token_indices_cover_pages_above_the_sink(page_size):
    pools = make(page_size, pages=4)
    owner, row = new_row(pools, "a")
    tokens = pools.kv.extend(np.array([row]), np.array([4 * page_size]))
    assert sorted(tokens.tolist()) == list(range(page_size, 5 * page_size))
    with pytest.raises(PoolExhausted):
        pools.kv.decode(np.array([row]))
    assert_clean(pools, row_claims(pools, owner, row), idle=False)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_extend_continues_the_partial_page(page_size):
    pools = make(page_size)
    _owner, row = new_row(pools, "a")
    first = pools.kv.extend(np.array([row]), np.array([3]))
    free_before = pools.kv_pages.free_count
    second = pools.kv.extend(np.array([row]), np.array([3 + page_size]))
    all_tokens = np.concatenate([first, second])
    assert_page_aligned(all_tokens, page_size)
    assert np.array_equal(all_tokens, pools.rows.token_indices(row, 0, 3 + page_size))
    expected_new = -(-(3 + page_size) // page_size) - -(-3 // page_size)
    assert free_before - pools.kv_pages.free_count == expected_new


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decode_takes_a_page_only_when_the_last_is_full(page_size):
    pools = make(page_size)
    _owner, row = new_row(pools, "a")
    pools.kv.extend(np.array([row]), np.array([1]))
    taken = []
    for _ in range(2 * page_size):
        before = pools.kv_pages.free_count
        length = int(pools.rows.lens[row])
        pools.kv.decode(np.array([row]))
        taken.append(before - pools.kv_pages.free_count)
        assert taken[-1] == (1 if length % page_size == 0 else 0)
    assert_page_aligned(pools.rows.token_indices(row, 0, int(pools.rows.lens[row])), page_size)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_batched_extend_and_decode_keep_rows_apart(page_size):
    pools = make(page_size, pages=200)
    owners_rows = [new_row(pools, f"r{i}") for i in range(5)]
    rows = np.array([r for _, r in owners_rows])
    pools.kv.extend(rows, np.array([1, 7, 16, 17, 33]))
    for _ in range(20):
        pools.kv.decode(rows)
    per_row = [pools.rows.token_indices(r, 0, int(pools.rows.lens[r])) for r in rows]
    assert_no_overlap(*per_row)
    for tokens in per_row:
        assert_page_aligned(tokens, page_size)
    claims = [c for owner, row in owners_rows for c in row_claims(pools, owner, row)]
    assert_clean(pools, claims, idle=False)


def test_batched_extend_is_all_or_nothing():
    pools = make(4, pages=5)
    (_oa, a), (_ob, b) = new_row(pools, "a"), new_row(pools, "b")
    before = pools.rows.pages.copy()
    with pytest.raises(PoolExhausted):
        pools.kv.extend(np.array([a, b]), np.array([12, 12]))
    assert np.array_equal(pools.rows.pages, before)
    assert pools.rows.lens[a] == pools.rows.lens[b] == 0 and pools.kv_pages.free_count == 5


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("start", [0, 1, 5, 16, 17, 31])
def test_free_tail_rounds_up_to_a_page_boundary(page_size, start):
    pools = make(page_size)
    owner, row = new_row(pools, "a")
    pools.kv.extend(np.array([row]), np.array([40]))
    kept_pages = -(-start // page_size)
    before = pools.rows.token_indices(row, 0, start)
    pools.kv.free_tail(row, start)
    assert pools.rows.lens[row] == start
    assert pools.kv_pages.held_by_kind()[OwnerKind.REQUEST] == kept_pages
    assert np.array_equal(pools.rows.token_indices(row, 0, start), before)
    pools.kv.extend(np.array([row]), np.array([start + 3]))  # continues the kept partial page
    assert_page_aligned(pools.rows.token_indices(row, 0, start + 3), page_size)
    assert_clean(pools, row_claims(pools, owner, row), idle=False)


def test_extend_refuses_shrinking_and_overlong():
    pools = make(1, context=16)
    _, row = new_row(pools, "a")
    pools.kv.extend(np.array([row]), np.array([8]))
    with pytest.raises(ValueError):
        pools.kv.extend(np.array([row]), np.array([4]))
    with pytest.raises(ValueError):
        pools.kv.extend(np.array([row]), np.array([17]))


def test_pages_of_a_row_cannot_be_freed_by_another_owner():
    pools = make(4)
    _, a = new_row(pools, "a")
    other, _ = new_row(pools, "b")
    pools.kv.extend(np.array([a]), np.array([8]))
    with pytest.raises(OwnershipError, match="does not own"):
        pools.kv_pages.free(pools.rows.row_pages(a, 0, 8), other)
