"""The rule for KV a holder borrows from the prefix cache (docs/ownership.md, "Shared
prefixes"): the cache keeps ownership of the pages; a running request, or a session
between turns, borrows exactly the path down to one node (its `cache_node`) and holds one
lock on that path. So its row's first `borrowed` positions are that path's pages, and
every node's lock count is the number of holders whose path runs through it (the root
keeps one lock of its own). A lock nobody holds would keep pages from eviction for good;
a holder without its lock could lose its pages to eviction while it reads them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np

from services.scheduler.allocators.request_rows import RowTable
from services.scheduler.cache.node import CacheNode
from services.scheduler.cache.radix_cache import RadixCache

Borrower = tuple[str, int, int, CacheNode | None]  # (who, its row, positions borrowed, node)


def borrow_problems(cache: RadixCache, rows: RowTable, borrowers: Iterable[Borrower]) -> list[str]:
    """Each breach of the rule, named."""
    out: list[str] = []
    locks: Counter[CacheNode] = Counter()
    for who, row, borrowed, node in borrowers:
        if node is None:
            if borrowed:
                out.append(f"{who} borrows {borrowed} positions with no cache node")
            continue
        if node.end != borrowed:
            out.append(f"{who} borrows {borrowed} positions of a path to {node.end}")
        path = node.path()
        if not path or path[0].parent is not cache.root:
            out.append(f"{who} borrows from {node}, no longer in the tree")
            continue
        tree = np.concatenate([n.pages for n in path])
        if not np.array_equal(rows.row_pages(row, 0, borrowed), tree):
            out.append(f"{who}: row {row}'s first pages are not its cache path's")
        locks.update(path)
    for n in cache.nodes():
        if n.kv_lock != locks[n]:
            out.append(f"{n}: {n.kv_lock} locks, {locks[n]} borrowers through it")
    return out
