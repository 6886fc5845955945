"""A node of the radix prefix cache.

A node owns (in the ledger) the KV pages of its edge and, optionally, the Mamba slot
holding the state after its last token. A node without a state is a tombstone: its KV
still serves as a prefix, but no match can end there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.scheduler.ownership.owners import Owner


@dataclass(eq=False)
class CacheNode:
    owner: Owner  # cache:<id>
    key: np.ndarray  # token ids of this edge; length a multiple of the page size
    pages: np.ndarray  # KV pages of this edge, one per page of `key`
    parent: CacheNode | None
    end: int  # tokens from the root to the end of this node
    mamba: int = 0  # state slot after the last token; 0 for a tombstone
    children: dict[tuple, CacheNode] = field(default_factory=dict)  # by (namespace, page)
    kv_lock: int = 0  # borrowers of the KV on the path through this node
    copy_lock: int = 0  # deferred copies from `mamba` not yet run
    copies_below: int = 0  # copy locks here and below: while any, this never becomes a leaf
    kv_time: int = 0
    mamba_time: int = 0
    hashes: bytes = b""  # chained hashes of `key`'s pages, when the cache logs (cache_log.py)
    namespace: str = ""  # whose requests may match it (shared/messages/cache.py); "": all

    @property
    def start(self) -> int:
        return self.end - len(self.key)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def path(self) -> list[CacheNode]:
        """Nodes from the first below the root down to this one."""
        nodes, node = [], self
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]

    def __repr__(self) -> str:
        state = f"state {self.mamba}" if self.mamba else "tombstone"
        locks = f"{self.kv_lock}/{self.copy_lock}"
        return f"<{self.owner} [{self.start}:{self.end}] {state} locks {locks}>"
