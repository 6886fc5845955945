"""The eviction indexes of the radix cache: random inserts, matches, locks and copy locks
taken and released, and evictions of both kinds, with every victim checked against a walk
of the tree (it qualifies and nothing that qualifies is older) and the indexes checked
against a walk after every step (RadixCache.problems). So are the evictable counts the KV
utilisation gauge reads (runtime/metrics.py), against a walk of their own here and by
what eviction then frees. The engine machine runs the same problems() check after each
engine step; this one reaches the cache's locks directly."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.scheduler.cache.lru import LruIndex
from services.scheduler.cache.node import CacheNode
from services.scheduler.cache.radix_cache import RadixCache
from tests.cache.harness import CacheHarness

# Two short prefixes make shared paths, splits and tombstones common.
tokens = st.builds(
    lambda prefix, rest: prefix + rest,
    st.sampled_from([[], [1, 2], [1, 2, 3, 4], [5, 6]]),
    st.lists(st.integers(1, 6), min_size=1, max_size=6),
)


def kv_qualifies(n: CacheNode) -> bool:
    return n.parent is not None and not n.children and n.kv_lock == 0 and n.copy_lock == 0


def mamba_qualifies(n: CacheNode) -> bool:
    """A state eviction may take now; a junction's (two or more children) only once no
    other state qualifies."""
    return n.mamba != 0 and n.copy_lock == 0 and not (not n.children and n.kv_lock > 0)


def junction(n: CacheNode) -> bool:
    return len(n.children) > 1


def pinned(n: CacheNode) -> bool:
    """Its KV stays whatever is evicted: borrowed, or above (or at) a pending copy."""
    return n.kv_lock > 0 or n.copy_lock > 0 or any(map(pinned, n.children.values()))


def check_victims(
    cache: RadixCache,
    index: LruIndex[CacheNode],
    qualifies: Callable[[CacheNode], bool],
    stamp: Callable[[CacheNode], int],
) -> None:
    """Wrap `index.oldest` so that each victim it names is checked against a walk."""
    oldest = index.oldest

    def checked() -> CacheNode | None:
        victim = oldest()
        pool = [n for n in cache.nodes() if qualifies(n)]
        if victim is None:
            assert pool == []
        else:
            assert qualifies(victim) and stamp(victim) == min(map(stamp, pool))
        return victim

    index.oldest = checked


class IndexMachine(RuleBasedStateMachine):
    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        self.h = CacheHarness(page_size=self.page_size, kv_pages=48, mamba_slots=12)
        cache = self.h.cache
        check_victims(cache, cache._kv_lru, kv_qualifies, lambda n: n.kv_time)
        check_victims(
            cache,
            cache._mamba_lru,
            lambda n: mamba_qualifies(n) and not junction(n),
            lambda n: n.mamba_time,
        )
        check_victims(
            cache,
            cache._junction_lru,
            lambda n: mamba_qualifies(n) and junction(n),
            lambda n: n.mamba_time,
        )
        self.kv_locks: list[CacheNode] = []
        self.copy_locks: list[CacheNode] = []
        self.value = 0

    @rule(new=tokens)
    def insert(self, new):
        pools, cache = self.h.pools, self.h.cache
        cache.evict_kv(len(new) - pools.kv_pages.free_count)
        cache.evict_mamba(1 - pools.mamba.free_count)
        if pools.kv_pages.free_count >= len(new) and pools.mamba.free_count:
            self.value += 1
            self.h.insert(new, self.value)

    @rule(new=tokens, kv=st.booleans(), copy=st.booleans())
    def match(self, new, kv, copy):
        node = self.h.match(new).node
        if node is not self.h.cache.root and kv:
            self.h.cache.lock(node)
            self.kv_locks.append(node)
        if node is not self.h.cache.root and copy:
            self.h.cache.lock_copy(node)
            self.copy_locks.append(node)

    @precondition(lambda self: self.kv_locks)
    @rule(data=st.data())
    def unlock(self, data):
        node = self.kv_locks.pop(data.draw(st.integers(0, len(self.kv_locks) - 1)))
        self.h.cache.unlock(node)

    @precondition(lambda self: self.copy_locks)
    @rule(data=st.data())
    def unlock_copy(self, data):
        node = self.copy_locks.pop(data.draw(st.integers(0, len(self.copy_locks) - 1)))
        self.h.cache.unlock_copy(node)

    @rule(pages=st.integers(0, 12))
    def evict_kv(self, pages):
        """What it frees was counted evictable; if it frees too few, none was left."""
        cache = self.h.cache
        before = cache.evictable_pages
        freed = cache.evict_kv(pages)
        assert cache.evictable_pages == before - freed
        assert freed >= pages or cache.evictable_pages == 0

    @rule(states=st.integers(0, 4))
    def evict_mamba(self, states):
        cache = self.h.cache
        freed = cache.evict_mamba(states)
        assert freed == states or cache.evictable_states == 0

    @invariant()
    def indexes_are_exact(self):
        self.h.check()

    @invariant()
    def evictable_counts_match_a_walk(self):
        """The counts kept as nodes change (read in O(1) by a scrape) against a walk."""
        nodes = list(self.h.cache.nodes())
        free_pages = sum(len(n.pages) for n in nodes if not pinned(n))
        assert self.h.cache.evictable_pages == free_pages
        assert self.h.cache.evictable_states == sum(map(mamba_qualifies, nodes))

    @invariant()
    def reclaimable_states_are_those_eviction_may_take(self):
        """What room-making counts on (engine/room.py) is what `evict_mamba` may free."""
        nodes = list(self.h.cache.nodes())
        assert self.h.cache.reclaimable_states([]) == sum(map(mamba_qualifies, nodes))

    def teardown(self):
        for node in self.kv_locks:
            self.h.cache.unlock(node)
        for node in self.copy_locks:
            self.h.cache.unlock_copy(node)
        self.h.cache.evict_kv(1 << 30)
        self.h.cache.evict_mamba(1 << 30)
        assert list(self.h.cache.nodes()) == []
        assert (self.h.cache.evictable_pages, self.h.cache.evictable_states) == (0, 0)
        self.h.check()


class IndexMachinePages2(IndexMachine):
    page_size = 2


SETTINGS = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = SETTINGS
TestIndexMachinePages2 = IndexMachinePages2.TestCase
TestIndexMachinePages2.settings = SETTINGS


def test_an_unlocked_leaf_keeps_the_place_of_its_last_access():
    h = CacheHarness()
    x = h.insert([1], 1)
    h.insert([2], 2)
    h.insert([3], 3)
    h.cache.lock(h.match([1]).node)  # x is accessed, then borrowed ...
    h.match([2])
    h.match([3])
    h.cache.unlock(x)  # ... and released after [2] and [3] were accessed
    assert h.cache.evict_kv(1) == 1 and x.parent is None  # still the least recent
    h.check()


def test_a_node_left_a_leaf_above_pruned_tombstones_goes_in_lru_order():
    h = CacheHarness()
    a = h.insert([1, 2, 3], 1)
    h.insert([1, 2, 3, 4, 5, 6, 7], 2)
    h.insert([1, 2, 3, 4, 5, 60, 70], 3)  # splits [4..7]: [4,5] is a tombstone
    e = h.insert([9, 9], 4)
    # [6,7] and [60,70] go, then the tombstone [4,5] is pruned, which leaves a leaf older
    # than e: it goes next, in the same call.
    assert h.cache.evict_kv(7) == 9
    assert a.parent is None and e.parent is not None
    h.check()


def test_a_state_pinned_by_a_running_request_is_not_counted_reclaimable():
    """A leaf whose KV a running request borrows keeps its state; an idle session's borrow
    (`released`: given up if room needs it) does not keep it."""
    h = CacheHarness()
    node = h.insert([1, 2, 3], 7)
    cache = h.cache
    assert cache.reclaimable_states([]) == 1
    cache.lock(node)  # the idle session
    cache.lock(node)  # a running request
    assert cache.reclaimable_states([]) == 0
    assert cache.reclaimable_states([node]) == 0  # the running request still borrows it
    cache.unlock(node)  # the running request ends
    assert cache.reclaimable_states([node]) == 1 and cache.reclaimable_states([]) == 0
    cache.unlock(node)


def test_a_drifted_evictable_count_fails_the_integrity_check():
    """The cache's check (RadixCache.problems, run by the engine's idle-loop audit)
    recounts by a walk, so a count kept wrong is a violation, not a quietly wrong gauge."""
    h = CacheHarness()
    a = h.insert([1, 2, 3], 1)
    b = h.insert([1, 2, 4], 2)  # [1, 2] is split off: a tombstone above a and b
    h.cache.lock_copy(a)
    assert (h.cache.evictable_pages, h.cache.evictable_states) == (1, 1)  # b's page, state
    h.check()
    h.cache.evictable_pages += 1
    assert "evictable (pages, states) kept as (2, 1), (1, 1) by a walk" in h.cache.problems()
    with pytest.raises(AssertionError):
        h.check()
    h.cache.evictable_pages -= 1
    h.cache._mamba_lru.update(b, False)  # a state eviction could take, left uncounted
    assert "evictable (pages, states) kept as (1, 0), (1, 1) by a walk" in h.cache.problems()
    h.cache._index(b)
    a.parent.copies_below = 0  # the copy pending below the tombstone, forgotten there
    assert any("0 copy locks kept below, 1 found" in p for p in h.cache.problems())
    a.parent.copies_below = 1
    h.cache.unlock_copy(a)
    h.check()
