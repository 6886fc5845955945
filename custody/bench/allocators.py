"""`custody bench allocators`: custody's allocators, ledger on, against SGLang's.

Three operations, each timed for both in the same run:
- Mamba slot alloc(1) + free pairs;
- one decode step of 256 rows on a paged KV pool (page size 16): the new position's
  token index for every row, a new page where a row's last page is full;
- one prefill batch of 8 rows extending from partly filled pages.
SGLang receives what its scheduler would pass (CPU tensors, `last_loc` gathered from
its `req_to_token`); its writes of the result into `req_to_token` are left out of its
time, while custody's time includes writing its own page table.

Beside them, the radix cache's eviction per node (allocators-eviction.*), with 1k and 100k
nodes cached, against the scan it replaced: a heap or a sort over every node per call.
"""

from __future__ import annotations

import gc
import heapq
import time
from collections import deque
from collections.abc import Callable
from functools import partial

import numpy as np

from custody.bench.harness import Row, side_by_side, table, write_results
from custody.bench.sglang_reference import SGLANG_VERSION, load_allocators
from services.scheduler.allocators.pools import PoolConfig, Pools
from services.scheduler.cache.radix_cache import RadixCache
from services.scheduler.ownership.owners import OwnerKind

PAGE = 16
DECODE_ROWS, DECODE_STEPS = 256, 32
EXTEND_ROWS = 8
MAMBA_SLOTS, MAMBA_PAIRS = 1024, 20_000


def _rng() -> np.random.Generator:
    return np.random.default_rng(7)


# ---------------------------------------------------------------- Mamba slots
def mamba_ours() -> float:
    pools = Pools(PoolConfig(mamba_slots=MAMBA_SLOTS))
    owner = pools.ledger.new_owner(OwnerKind.REQUEST, "bench")
    alloc, free = pools.mamba.alloc_one, pools.mamba.free_one
    start = time.perf_counter()
    for _ in range(MAMBA_PAIRS):
        free(alloc(owner), owner)
    elapsed = time.perf_counter() - start
    assert pools.ledger.events.drain_count() == 2 * MAMBA_PAIRS  # the ledger was on
    return elapsed / MAMBA_PAIRS


def mamba_reference(cls: type) -> float:
    allocator = cls(MAMBA_SLOTS, "cpu")
    alloc, free = allocator.alloc, allocator.free
    start = time.perf_counter()
    for _ in range(MAMBA_PAIRS):
        free(alloc(1))
    return (time.perf_counter() - start) / MAMBA_PAIRS


# ---------------------------------------------------------------- paged decode
def _start_lens(n: int) -> np.ndarray:
    return _rng().integers(1, 512, size=n)


def _pages_for(lens: np.ndarray, grow_to: np.ndarray) -> int:
    return int((np.maximum(lens, grow_to) // PAGE + 2).sum()) + 64


def _pools_with_rows(lens: np.ndarray, pages: int) -> tuple[Pools, np.ndarray]:
    n = len(lens)
    pools = Pools(
        PoolConfig(
            kv_pages=pages, page_size=PAGE, max_running_requests=n, mamba_slots=1, max_context=2048
        )
    )
    rows = np.array(
        [pools.req.alloc_one(pools.ledger.new_owner(OwnerKind.REQUEST, str(i))) for i in range(n)]
    )
    pools.kv.extend(rows, lens)
    pools.ledger.events.drain_count()
    return pools, rows


def decode_ours() -> float:
    lens = _start_lens(DECODE_ROWS)
    pools, rows = _pools_with_rows(lens, _pages_for(lens, lens + DECODE_STEPS))
    decode = pools.kv.decode
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        decode(rows)
    return (time.perf_counter() - start) / DECODE_STEPS


def _reference_with_rows(cls: type, lens: np.ndarray, pages: int):
    import torch

    n = len(lens)
    allocator = cls(pages * PAGE, PAGE, torch.int64, "cpu", None, False)
    req_to_token = torch.zeros((n + 1, 2048), dtype=torch.int64)
    rows = torch.arange(1, n + 1)
    seq = torch.tensor(lens, dtype=torch.int64)
    zeros = torch.zeros(n, dtype=torch.int64)
    out = allocator.alloc_extend(zeros, zeros, seq, seq, torch.full((n,), -1), int(seq.sum()))
    starts = torch.cumsum(seq, 0) - seq
    for i in range(n):
        req_to_token[i + 1, : lens[i]] = out[starts[i] : starts[i] + lens[i]]
    return allocator, req_to_token, rows, seq


def decode_reference(cls: type) -> float:
    lens = _start_lens(DECODE_ROWS)
    allocator, req_to_token, rows, seq = _reference_with_rows(
        cls, lens, _pages_for(lens, lens + DECODE_STEPS)
    )
    elapsed = 0.0
    for _ in range(DECODE_STEPS):
        seq = seq + 1
        start = time.perf_counter()
        last_loc = req_to_token[rows, seq - 2]
        out = allocator.alloc_decode(seq, seq, last_loc)
        elapsed += time.perf_counter() - start
        req_to_token[rows, seq - 1] = out
    return elapsed / DECODE_STEPS


# ---------------------------------------------------------------- paged extend
def _extend_batch() -> tuple[np.ndarray, np.ndarray]:
    rng = _rng()
    prefix = rng.integers(0, 300, size=EXTEND_ROWS)
    return prefix, prefix + rng.integers(64, 1024, size=EXTEND_ROWS)


EXTEND_CALLS = 50


def extend_ours() -> float:
    prefix, new = _extend_batch()
    prefix = np.maximum(prefix, 1)
    pools, rows = _pools_with_rows(prefix, _pages_for(prefix, new))
    elapsed = 0.0
    for _ in range(EXTEND_CALLS):
        start = time.perf_counter()
        pools.kv.extend(rows, new)
        elapsed += time.perf_counter() - start
        for row, p in zip(rows, prefix, strict=True):
            pools.kv.free_tail(int(row), int(p))  # reset for the next call, untimed
    return elapsed / EXTEND_CALLS


def extend_reference(cls: type) -> float:
    import torch

    prefix, new = _extend_batch()
    prefix = np.maximum(prefix, 1)
    allocator, req_to_token, rows, seq = _reference_with_rows(cls, prefix, _pages_for(prefix, new))
    new_t = torch.tensor(new, dtype=torch.int64)
    saved = allocator.free_pages.clone()
    elapsed = 0.0
    for _ in range(EXTEND_CALLS):
        start = time.perf_counter()
        last_loc = req_to_token[rows, seq - 1]
        allocator.alloc_extend(seq, seq, new_t, new_t, last_loc, int((new_t - seq).sum()))
        elapsed += time.perf_counter() - start
        allocator.free_pages = saved.clone()  # reset for the next call, untimed
    return elapsed / EXTEND_CALLS


# ---------------------------------------------------------------- cache eviction
EVICT_SIZES = {"1k": 1_000, "100k": 100_000}
EVICT_BATCH = 64  # one-page nodes taken per eviction call


class FilledCache:
    """`n` one-page leaves with states. What each eviction call takes is inserted again,
    untimed, as the newest: every call starts from `n` (only if the oldest went: checked)."""

    def __init__(self, n: int) -> None:
        slots = n + EVICT_BATCH
        self.pools = Pools(PoolConfig(kv_pages=slots, page_size=PAGE, mamba_slots=slots))
        self.cache = RadixCache(self.pools)
        self.giver = self.pools.ledger.new_owner(OwnerKind.REQUEST, "bench")
        self.order = deque(range(1, n + 1))  # each node's token, least recent first
        gc.disable()  # untimed, and collections over a growing tree slow it down
        for token in self.order:
            self._insert(token)
        gc.enable()  # on while timed: collections are part of what the scan costs
        gc.collect()  # but the tree settled in the oldest generation first

    def _insert(self, token: int) -> None:
        pages = self.pools.kv_pages.alloc(1, self.giver)
        self.cache.insert(np.full(PAGE, token), pages, self.giver, self.pools.mamba.alloc_one)

    def per_node(self, evict: Callable[[RadixCache, int], int]) -> float:
        """Seconds per evicted node of one `evict` call taking EVICT_BATCH, then a refill."""
        self.pools.ledger.events.drain_count()
        start = time.perf_counter()
        freed = evict(self.cache, EVICT_BATCH)
        elapsed = time.perf_counter() - start
        for _ in range(EVICT_BATCH):
            self._insert(self.order[0])
            self.order.rotate(-1)
        assert freed == EVICT_BATCH and len(self.cache.root.children) == len(self.order)
        return elapsed / EVICT_BATCH


def scan_evict_kv(cache: RadixCache, pages: int) -> int:
    """RadixCache.evict_kv before its index: a heap from a walk of the tree, per call."""
    heap = [(n.kv_time, id(n), n) for n in cache.nodes() if cache._kv_evictable(n)]
    heapq.heapify(heap)
    freed = 0
    while freed < pages and heap:
        _, _, node = heapq.heappop(heap)
        parent = node.parent
        freed += cache._remove(node)
        freed += cache._prune(parent)
        if parent.parent is not None and parent.children == {} and cache._kv_evictable(parent):
            heapq.heappush(heap, (parent.kv_time, id(parent), parent))
    return freed


def scan_evict_mamba(cache: RadixCache, states: int) -> int:
    """RadixCache.evict_mamba before its index: every state, sorted by recency, per call."""
    order = sorted((n for n in cache.nodes() if n.mamba), key=lambda n: n.mamba_time)
    freed = 0
    for node in order:
        if freed >= states:
            break
        if node.copy_lock or (node.is_leaf and node.kv_lock):
            continue
        cache.evict_state(node)
        freed += 1
    return freed


def eviction_rows(repeats: int) -> list[Row]:
    """Ours and the scan in turn on one cache per size, built once."""
    kinds = (
        ("KV", RadixCache.evict_kv, scan_evict_kv),
        ("Mamba", RadixCache.evict_mamba, scan_evict_mamba),
    )
    rows = []
    for label, n in EVICT_SIZES.items():
        per = FilledCache(n).per_node
        for name, ours, scan in kinds:
            key = f"ratio_evict_{name.lower()}_{label}"
            what = f"{name} eviction per node, {label} nodes cached, {EVICT_BATCH} a call"
            ours_s, ref_s = side_by_side(partial(per, ours), partial(per, scan), repeats, key)
            rows.append(Row(key, what, "s/node", ours_s, ref_s, "scan per call (before)", 0))
    return rows


def run(repeats: int = 7) -> dict:
    mamba_cls, paged_cls = load_allocators()
    ref = f"SGLang {SGLANG_VERSION}"
    specs = [
        (
            "ratio_mamba_alloc_free",
            "Mamba slot alloc(1)+free pair",
            mamba_ours,
            lambda: mamba_reference(mamba_cls),
            10.0,
        ),
        (
            "ratio_paged_decode_batch256",
            f"paged decode step, {DECODE_ROWS} rows, page {PAGE}",
            decode_ours,
            lambda: decode_reference(paged_cls),
            3.0,
        ),
        (
            "ratio_paged_extend",
            f"paged extend, {EXTEND_ROWS}-row prefill batch, page {PAGE}",
            extend_ours,
            lambda: extend_reference(paged_cls),
            3.0,
        ),
    ]
    rows = []
    for key, what, ours, reference, target in specs:
        ours_s, ref_s = side_by_side(ours, reference, repeats, key)
        rows.append(Row(key, what, "s/op", ours_s, ref_s, ref, target))
    payload = write_results("allocators", rows, {"repeats": repeats, "ledger": "on"})
    evictions = eviction_rows(repeats)
    ns = {r.key: {"custody": r.ours_s * 1e9, "scan": r.reference_s * 1e9} for r in evictions}
    extra = {"repeats": repeats, "nodes_per_call": EVICT_BATCH, "median_ns_per_node": ns}
    payload["eviction"] = write_results("allocators-eviction", evictions, extra)
    payload["table"] = table(rows + evictions)
    return payload
