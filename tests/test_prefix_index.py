"""The router's prefix index against real cache messages: built from a radix cache's own
log through random inserts, splits and evictions, it matches what the cache would serve
and holds what a fresh snapshot holds; a duplicate is dropped, a gap or a new epoch
clears it and asks for a snapshot. Then the choice: the longest match within the load
bound, a prompt no replica holds to the smallest cache, and the prompt read as the
replicas read it."""

from __future__ import annotations

import numpy as np
import pytest

from fronts.choice import Choice, Chooser, choose, eligible
from fronts.prefix_index import PrefixIndex, ReplicaIndex
from fronts.replicas import Replica, ReplicaTable
from services.router.metrics import RouterMetrics
from services.scheduler.runtime.cache_shipper import CacheShipper
from shared.messages.cache import CacheEvents, Removed, Stored, chain
from shared.messages.envelope import encode
from shared.tokenizer import ByteTokenizer, load_tokenizer
from tests.cache.harness import CacheHarness


def served(h: CacheHarness, tokens: list[int]) -> int:
    """What the cache itself would serve of a request of `tokens`."""
    return h.cache.match(np.array(tokens), len(tokens) - 1).length


def test_the_index_follows_the_cache_through_splits_and_evictions():
    rng = np.random.default_rng(3)
    h = CacheHarness(page_size=2, kv_pages=64, mamba_slots=12)
    shipper = CacheShipper(h.cache, "e1")
    index, fresh = ReplicaIndex(), ReplicaIndex()
    assert not index.apply(shipper.snapshot())
    queries = [rng.integers(0, 3, 24).tolist() for _ in range(30)]
    for step in range(300):
        what = rng.random()
        if what < 0.6:
            prefix = queries[rng.integers(len(queries))][: rng.integers(2, 24)]
            tokens = prefix + rng.integers(0, 3, rng.integers(0, 6)).tolist()
            h.cache.evict_kv(len(tokens) - h.pools.kv_pages.free_count)  # room, as admission
            h.cache.evict_mamba(1 - h.pools.mamba.free_count)
            h.insert(tokens, step)
        elif what < 0.8:
            h.cache.evict_kv(int(rng.integers(1, 6)))
        else:
            h.cache.evict_mamba(1)
        batch = shipper.batch()
        if batch is not None:
            assert not index.apply(batch)
        pool = PrefixIndex()
        pool.replicas["r"] = index
        for q in queries[:10]:
            assert pool.match(q, ["r"]).get("r", 0) == served(h, q), (step, q)
    assert index.gaps == 0 and len(index.ends) > 3
    assert not fresh.apply(shipper.snapshot())
    assert fresh.ends == index.ends and fresh.present.keys() == index.present.keys()
    h.check()


def test_a_duplicate_is_dropped_and_a_gap_or_a_new_epoch_clears_the_index():
    h = CacheHarness(page_size=4)
    shipper = CacheShipper(h.cache, "e1")
    index = ReplicaIndex()
    index.apply(shipper.snapshot())
    h.insert(list(range(16)), 1)
    first = shipper.batch()
    assert not index.apply(first) and not index.apply(first)  # the second is a duplicate
    assert index.seq == 2 and len(index.present) == 4
    h.insert(list(range(8)) + [9] * 8, 2)
    shipper.batch()  # lost on the way
    h.insert([5] * 12, 3)
    assert index.apply(shipper.batch())  # a gap: cleared, a snapshot wanted
    assert not index.ready and not index.present
    assert not index.apply(encode(CacheEvents(epoch="e1", seq=9, ops=[])))  # waits
    index.apply(shipper.snapshot())
    assert index.ready and len(index.ends) == 3
    other = encode(CacheEvents(epoch="e2", seq=1, ops=[Removed(7)]))
    assert index.apply(other) and not index.ready  # another scheduler life
    assert index.apply(b"\x00garbage") and index.gaps == 3


def test_match_lengths_end_where_a_node_serves():
    index, pool = ReplicaIndex(), PrefixIndex()
    pool.replicas["a"] = index
    a = list(range(40))
    snapshot = CacheShipper(CacheHarness(page_size=4).cache, "e").snapshot()
    index.apply(snapshot)
    ops = [
        Stored(11, 0, chain(a[:16], 4)),
        Stored(12, 11, chain(a[16:32], 4, chain(a[:16], 4)[-8:])),
    ]
    index.apply(encode(CacheEvents(epoch="e", seq=2, ops=ops)))
    assert pool.match(a, ["a"]) == {"a": 32}
    assert pool.match(a[:33], ["a"]) == {"a": 32} and pool.match(a[:32], ["a"]) == {"a": 16}
    assert pool.match([7, *a], ["a"]) == {} and pool.match(a, ["b"]) == {}
    index.apply(encode(CacheEvents(epoch="e", seq=3, ops=[Removed(11)])))
    assert pool.match(a, ["a"]) == {"a": 32}  # 11 carries 12's first blocks
    assert pool.match(a[:20], ["a"]) == {}
    index.apply(encode(CacheEvents(epoch="e", seq=4, ops=[Removed(12)])))
    assert not index.nodes and not index.present


def replica(rid: str, load: int, sessions: int = 0) -> Replica:
    return Replica(rid, f"http://{rid}", True, load, 0, sessions, "e", warmed="e")  # connected


def test_the_longest_match_wins_within_the_load_bound():
    a, b, c = replica("a", 0), replica("b", 0), replica("c", 1)
    assert choose([a, b, c], {"c": 64}) == Choice(c, "prefix", 64)
    assert choose([a, b, c], {}).replica in (a, b)
    assert choose([a, b, c], {"a": 8, "b": 8, "c": 8}).decision == "load"
    hot = replica("c", 6)  # average 2, bound ceil(2.5) + 1 = 4
    assert eligible([a, b, hot]) == [a, b]
    assert choose([a, b, hot], {"c": 64, "b": 4}) == Choice(b, "prefix", 4)
    assert choose([replica("a", 2), replica("b", 1)], {}).replica.id == "b"


def test_a_prompt_no_replica_holds_goes_to_the_smallest_cache():
    a, b = replica("a", 0), replica("b", 2)  # average 1, bound 3: both eligible
    sizes = {"a": 4096, "b": 1024}
    assert choose([a, b], {}, sizes) == Choice(b, "load", 0)  # before the lower load
    assert choose([a, b], {}).replica is a  # no sizes (no prompt read): load alone
    assert choose([a, b], {"a": 16}, sizes) == Choice(a, "prefix", 16)  # a match first
    assert choose([a, b], {}, {"a": 1024, "b": 1024}).replica is a  # equal: load
    hot = replica("b", 6)  # average 3, bound ceil(3.75) + 1 = 5
    assert choose([a, hot], {}, sizes).replica is a  # the bound still holds


def indexed(block: int, prompts: dict[str, list[int]]) -> PrefixIndex:
    """An index whose replica `rid` caches `prompts[rid]` as one node (none if empty)."""
    pool = PrefixIndex()
    snapshot = CacheShipper(CacheHarness(page_size=block).cache, "e").snapshot()
    for rid, tokens in prompts.items():
        pool.replica(rid).apply(snapshot)
        if tokens:
            ops = [Stored(1, 0, chain(tokens, block))]
            pool.replica(rid).apply(encode(CacheEvents(epoch="e", seq=2, ops=ops)))
    return pool


def test_the_chooser_fills_the_emptier_cache_and_counts_diversions():
    shared = list(range(32))
    pool = indexed(4, {"a": shared, "b": []})
    assert pool.cached_tokens("a") == 32 and pool.cached_tokens("b") == 0
    table = ReplicaTable(None, 1.0)
    table.live = {"a": replica("a", 0), "b": replica("b", 1)}
    metrics = RouterMetrics(table)
    chooser = Chooser(table, pool, ByteTokenizer(), 1024, metrics.prefix)
    other = {"input_ids": [9] * 40}
    assert chooser.pick("/generate", other, None) == Choice(table.live["b"], "load", 0)
    assert chooser.pick("/v1/chat/completions", {}, None).replica.id == "a"  # no prompt: load
    mine = {"input_ids": [*shared, 5]}
    assert chooser.pick("/generate", mine, None) == Choice(table.live["a"], "prefix", 32)
    table.live["a"].running = 8  # past the bound (7): the prompt goes elsewhere, counted
    assert chooser.pick("/generate", mine, None).replica.id == "b"
    diverted = metrics.registry.get_sample_value(
        "custody_router_prefix_diverted_total", {"replica": "a"}
    )
    assert diverted == 1


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [
        ("/generate", {"input_ids": [1, 2, 3]}, [1, 2, 3]),
        ("/generate", {"input_ids": [[4, 5], [6]]}, [4, 5]),
        ("/generate", {"text": "hi"}, [104, 105]),
        ("/generate", {"text": ["yo", "x"]}, [121, 111]),
        ("/v1/completions", {"prompt": "ok"}, [111, 107]),
        ("/v1/completions", {"prompt": [9, 8]}, [9, 8]),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, None),
        ("/generate", {"input_ids": [1, "x"]}, None),
        ("/generate", {"text": 5}, None),
        ("/generate", None, None),
    ],
)
def test_the_prompt_is_read_as_the_replicas_read_it(path, body, expected):
    chooser = Chooser(
        ReplicaTable(None, 1.0),
        PrefixIndex(),
        ByteTokenizer(),
        1024,
        RouterMetrics(ReplicaTable(None, 1.0)).prefix,
    )
    assert chooser.prompt(path, body) == expected


def test_an_ids_only_deployment_routes_text_by_load(tmp_path):
    tokenizer = load_tokenizer(tmp_path)  # no tokenizer.json: ids only
    table = ReplicaTable(None, 1.0)
    table.live = {"a": replica("a", 0)}
    chooser = Chooser(table, PrefixIndex(), tokenizer, 1024, RouterMetrics(table).prefix)
    assert chooser.prompt("/generate", {"text": "hi"}) is None
    assert chooser.pick("/generate", {"text": "hi"}, None).decision == "load"
