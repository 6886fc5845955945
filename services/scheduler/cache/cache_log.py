"""The radix cache's changes as routers see them (shared/messages/cache.py): which nodes
serve a match (hold a state), under which servable ancestor, with which block hashes.

The cache calls `stored` where a node gains a state and `removed` where one loses it (or
goes); a split changes nothing a router sees (the lower half keeps its end and its
state, the upper half is a tombstone), it only cuts the node's hashes in two. A node's
tokens are hashed once, when it is inserted, chained from its parent's last hash (at the
top, from its namespace's root); a match hashes nothing, so the cache's hot path stays
as it was.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.scheduler.cache.node import CacheNode
from shared.messages.cache import (
    HASH_BYTES,
    ROOT_NODE,
    Removed,
    Stored,
    chain,
    namespace_root,
)


class CacheLog:
    """The ops since the last `take`, in the order the tree changed."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.ops: list[Stored | Removed] = []

    def stored(self, node: CacheNode) -> None:
        """`node` now holds a state; a new node is hashed here, its only hashing."""
        if not node.hashes:
            parent = node.parent.hashes[-HASH_BYTES:] or namespace_root(node.namespace)
            node.hashes = chain(node.key, self.block, parent)
        self.ops.append(self.op(node))

    def removed(self, node: CacheNode) -> None:
        self.ops.append(Removed(node.owner.id))

    def take(self) -> list[Stored | Removed]:
        ops, self.ops = self.ops, []
        return ops

    def snapshot(self, nodes: Iterable[CacheNode]) -> list[Stored]:
        """The servable tree of `nodes` (parents first); the ops not yet taken are folded
        into it, so they are dropped."""
        self.ops = []
        return [self.op(n) for n in nodes if n.mamba]

    @staticmethod
    def op(node: CacheNode) -> Stored:
        """`node` under its nearest ancestor with a state: the hashes of the tombstones
        between them are its own too, as a match through them ends only at `node`."""
        parts, up = [node.hashes], node.parent
        while up.parent is not None and not up.mamba:
            parts.append(up.hashes)
            up = up.parent
        parent = ROOT_NODE if up.parent is None else up.owner.id
        return Stored(node.owner.id, parent, b"".join(reversed(parts)))
