"""Drive the radix cache the way finished requests do, with a data model of states."""

from __future__ import annotations

import numpy as np

from services.scheduler.allocators.pools import PoolConfig, Pools
from services.scheduler.cache.node import CacheNode
from services.scheduler.cache.radix_cache import RadixCache
from services.scheduler.ownership.owners import OwnerKind
from tests.scheduler.helpers import assert_integrity


class CacheHarness:
    def __init__(self, page_size: int = 1, kv_pages: int = 128, mamba_slots: int = 32) -> None:
        self.pools = Pools(
            PoolConfig(
                kv_pages=kv_pages,
                page_size=page_size,
                mamba_slots=mamba_slots,
                max_running_requests=8,
            )
        )
        self.cache = RadixCache(self.pools)
        self.states = np.zeros(mamba_slots + 1, dtype=np.int64)  # state content per slot
        self.n = 0

    def insert(
        self,
        tokens: list[int],
        value: int,
        borrowed: np.ndarray | None = None,
        namespace: str = "",
    ) -> CacheNode:
        """A request that computed `tokens` (after borrowing `borrowed` pages from the
        tree) caches them with its final state, whose content is `value`."""
        p, ps = self.pools, self.pools.config.page_size
        self.n += 1
        owner = p.ledger.new_owner(OwnerKind.REQUEST, f"ins{self.n}")
        row = p.req.alloc_one(owner)
        if borrowed is not None and len(borrowed):
            p.kv.borrow(row, borrowed)
        p.kv.extend(np.array([row]), np.array([len(tokens)]))
        slot = p.mamba.alloc_one(owner)
        self.states[slot] = value

        def donate(receiver):
            p.mamba.transfer_one(slot, owner, receiver, "donate")
            return slot

        length = len(tokens) - len(tokens) % ps
        node, tree_pages = self.cache.insert(
            np.array(tokens[:length]), p.rows.row_pages(row, 0, length), owner, donate, namespace
        )
        p.kv.adopt_prefix(row, tree_pages)
        if p.mamba.owner_of(slot) == owner.id:
            p.mamba.free_one(slot, owner)
        p.kv.free_tail(row, len(tree_pages) * ps)
        p.kv.forget(row)
        p.req.free_one(row, owner)
        p.ledger.retire(owner)
        return node

    def match(self, tokens: list[int], namespace: str = ""):
        return self.cache.match(np.array(tokens), len(tokens), namespace)

    def shape(self) -> list[tuple]:
        """(tokens from the root, edge, has state) of every node, sorted."""
        return sorted((n.start, tuple(n.key.tolist()), bool(n.mamba)) for n in self.cache.nodes())

    def check(self, claims: list | None = None) -> None:
        assert self.cache.problems() == []
        assert self.pools.kv.integrity_problems() == []
        assert_integrity(self.pools.ledger, self.cache.claims() + (claims or []), idle=not claims)
