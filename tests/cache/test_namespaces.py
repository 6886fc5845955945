"""Cache namespaces (docs/security.md, tenancy): a request matches only prefixes cached in
its own namespace, equal prompts of two namespaces are two branches of one tree with
one eviction order, and the routers' hashes of equal blocks differ between namespaces."""

from __future__ import annotations

from fronts.prefix_index import PrefixIndex
from shared.messages.cache import CacheSnapshot, cache_namespace, namespace_root
from shared.messages.envelope import encode
from tests.cache.harness import CacheHarness

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
ALPHA, BETA = cache_namespace("a" * 64, None), cache_namespace("b" * 64, None)


def test_a_prefix_serves_only_its_own_namespace():
    h = CacheHarness(page_size=2)
    h.insert(PROMPT, 1, namespace=ALPHA)
    assert h.match(PROMPT, ALPHA).length == 8
    assert h.match(PROMPT, BETA).length == 0
    assert h.match(PROMPT).length == 0  # keys off, nothing salted: another namespace too
    h.insert(PROMPT, 2, namespace=BETA)  # the same tokens again: a second branch
    assert h.states[h.match(PROMPT, BETA).node.mamba] == 2
    assert h.states[h.match(PROMPT, ALPHA).node.mamba] == 1
    fork = [*PROMPT[:4], 40, 41]
    h.insert(fork, 3, namespace=ALPHA)  # splits alpha's branch only
    assert h.match(fork, ALPHA).length == 6 and h.match(fork, BETA).length == 0
    assert h.match(PROMPT, BETA).length == 8
    h.check()
    assert h.cache.evict_kv(100) > 0  # one LRU over both: everything unlocked goes
    assert list(h.cache.nodes()) == []
    h.check()


def test_salted_requests_share_across_keys_and_nowhere_else():
    salt = cache_namespace("a" * 64, "team")
    assert salt == cache_namespace("b" * 64, "team") == cache_namespace(None, "team")
    assert len({salt, ALPHA, BETA, cache_namespace(None, None)}) == 4
    h = CacheHarness(page_size=2)
    h.insert(PROMPT, 1, namespace=salt)
    assert h.match(PROMPT, salt).length == 8 and h.match(PROMPT, ALPHA).length == 0
    h.check()


def test_the_routers_index_matches_within_the_namespace_only():
    h = CacheHarness(page_size=2)
    log = h.cache.record_events()
    h.insert(PROMPT, 1, namespace=ALPHA)
    h.insert(PROMPT, 2)
    snapshot = CacheSnapshot(epoch="e1", seq=1, block=2, ops=log.snapshot(h.cache.nodes()))
    index = PrefixIndex()
    assert not index.replica("r").apply(encode(snapshot))
    ask = [*PROMPT, 99]
    assert index.match(ask, ["r"], ALPHA) == {"r": 8}
    assert index.match(ask, ["r"], "") == {"r": 8}
    assert index.match(ask, ["r"], BETA) == {}
    assert len({namespace_root(ns) for ns in ("", ALPHA, BETA)}) == 3
