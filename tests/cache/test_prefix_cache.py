"""Scenarios P1-P3 and P7 of docs/scenarios.md on the radix cache."""

import numpy as np

from tests.cache.harness import CacheHarness


def test_p1_splits_tombstones_and_separate_eviction():
    h = CacheHarness()
    a = h.insert([1, 2, 3], 10)
    h.insert([1, 2, 3, 4, 5, 6, 7], 20)
    h.insert([10, 11, 12], 30)
    h.insert([1, 2, 3, 4, 5, 60, 70], 40)
    assert h.shape() == [
        (0, (1, 2, 3), True),
        (0, (10, 11, 12), True),
        (3, (4, 5), False),
        (5, (6, 7), True),
        (5, (60, 70), True),
    ]
    h.check()
    free_mamba = h.pools.mamba.free_count
    assert h.cache.evict_kv(1) == 3  # the LRU leaf [10,11,12] goes, with its state
    assert (0, (10, 11, 12), True) not in h.shape()
    assert h.pools.mamba.free_count == free_mamba + 1
    assert h.cache.evict_mamba(1) == 1  # LRU state: [1,2,3], an inner node: a tombstone
    assert (0, (1, 2, 3), False) in h.shape() and a.mamba == 0
    assert h.match([1, 2, 3, 4, 5]).length == 0
    assert h.match([1, 2, 3, 4, 5, 60, 70]).length == 7
    seven = h.match([1, 2, 3, 4, 5, 6, 7])
    assert seven.length == 7 and h.states[seven.node.mamba] == 20
    kv_before = h.pools.kv_pages.free_count
    assert h.cache.evict_mamba(1) == 1  # [60,70]: least recently matched, a leaf: KV too
    assert h.pools.kv_pages.free_count == kv_before + 2
    assert h.match([1, 2, 3, 4, 5, 60, 70]).length == 0
    h.check()


def test_p2_a_match_refreshes_only_the_state_it_uses():
    h = CacheHarness()
    a1 = h.insert([1, 2, 3], 1)
    h.insert([1, 2, 3, 4, 5, 6], 2)
    a2 = h.insert([7, 8, 9], 3)
    h.insert([7, 8, 9, 10, 11, 12], 4)
    h.match([1, 2, 3, 4, 5, 6])
    h.match([7, 8, 9, 10, 11, 12])
    assert a1.mamba_time < a2.mamba_time
    b1 = h.match([1, 2, 3, 4, 5, 6]).node
    assert b1.mamba_time > max(n.mamba_time for n in h.cache.nodes() if n is not b1)
    assert a1.mamba_time < a2.mamba_time
    assert h.cache.evict_mamba(1) == 1 and a1.mamba == 0 and a2.mamba != 0
    h.check()


def test_p3_duplicate_kv_is_freed_at_insert_the_borrowed_prefix_is_not():
    h = CacheHarness(kv_pages=64)
    free = h.pools.kv_pages.free_count
    h.insert([1, 2, 3], 1)  # a first insert keeps every position
    assert h.pools.kv_pages.free_count == free - 3
    m = h.match([1, 2, 3])  # request R borrows k=3 positions ...
    assert m.length == 3
    h.insert([1, 2, 3, 4, 5, 6], 2, borrowed=m.pages)  # ... while another caches [1..6]
    free = h.pools.kv_pages.free_count
    # R computed positions 4..10 and inserts them: 4,5,6 are duplicates and are freed at
    # once, 7..10 are new and stay; the 3 borrowed positions are the tree's own pages.
    h.insert(list(range(1, 11)), 3, borrowed=m.pages)
    assert h.pools.kv_pages.free_count == free - 4
    # k covering almost everything: 9 of 10 borrowed, the one computed already cached.
    m9 = h.cache.match(np.arange(1, 11), 9)
    assert m9.length == 6  # states at 3, 6 and 10: the best within 9 is at 6
    h.insert(list(range(1, 10)), 4, borrowed=m9.pages)  # cache a state at 9
    m9 = h.cache.match(np.arange(1, 11), 9)
    assert m9.length == 9
    free = h.pools.kv_pages.free_count
    h.insert(list(range(1, 11)), 5, borrowed=m9.pages)
    assert h.pools.kv_pages.free_count == free
    h.check()


def test_p3_with_pages_of_four():
    h = CacheHarness(page_size=4, kv_pages=32)
    free = h.pools.kv_pages.free_count
    h.insert(list(range(1, 11)), 1)  # 10 tokens: 8 cached (2 pages), the partial page freed
    assert h.pools.kv_pages.free_count == free - 2
    m = h.match(list(range(1, 9)))
    assert m.length == 8
    free = h.pools.kv_pages.free_count
    h.insert(list(range(1, 17)), 2, borrowed=m.pages[:1])  # borrowed 1 page, computed 3
    assert h.pools.kv_pages.free_count == free - 2  # 1 duplicate freed, 2 new pages kept
    h.check()


def test_p7_eviction_frees_donated_slots():
    h = CacheHarness()
    h.insert([1, 2, 3], 1)
    h.insert([4, 5, 6], 2)
    for _ in range(2):
        free = h.pools.mamba.free_count
        assert h.cache.evict_mamba(1) == 1
        assert h.pools.mamba.free_count == free + 1
    assert h.cache.evict_mamba(1) == 0
    h.check()
    assert np.all(h.pools.kv_pages.owner_view[1:] == 0)


def test_a_junction_s_state_goes_after_every_other_state():
    """A state where cached prefixes part serves every request that shares the prefix up
    to it; a leaf's serves one prompt. Least recently used alone took the junction's
    first here (it was cached first), leaving both branches to resume from nothing."""
    h = CacheHarness()
    junction = h.insert([1, 2, 3], 1)
    first = h.insert([1, 2, 3, 4, 5], 2)
    second = h.insert([1, 2, 3, 7, 8], 3)
    other = h.insert([9, 9, 9], 4)
    assert junction.mamba_time < first.mamba_time
    assert h.cache.evict_mamba(1) == 1 and junction.mamba != 0 and first.parent is None
    h.check()
    # with one branch gone it is a junction no more: least recently used again
    assert h.cache.evict_mamba(1) == 1 and junction.mamba == 0
    assert second.mamba != 0 and other.mamba != 0
    h.check()
