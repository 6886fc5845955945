"""The router's index of every replica's prefix cache, built from the cache messages each
scheduler ships on its ownership stream (shared/messages/cache.py), so a request can go
where its prompt is already cached.

Per replica it keeps the servable tree's nodes (their parent and block hashes), how many
nodes cover each block hash (`present`) and which hash ends a node that serves
(`ends`). A hash stands for its whole prefix (hashes are chained), so a replica serves
the longest prefix of a request that ends at a hash in `ends`, found by walking the
request's chain while its hashes are present.

Exactly once: a `CacheEvents` is applied only if it is the next `(epoch, seq)`; a
duplicate is dropped, and a gap, another epoch or a message that does not decode clears
the replica's index, which then waits for a snapshot (`apply` says when to ask for one).
A node that stops serving while nodes below it still pass through its blocks stays as a
carrier of those blocks until the last of them goes, as the scheduler's tombstones do.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shared.messages.cache import (
    CACHE_MESSAGES,
    CacheSnapshot,
    Stored,
    block_hashes,
    namespace_root,
)
from shared.messages.envelope import WireError

log = logging.getLogger("custody.router")


@dataclass(eq=False)
class _Node:
    parent: int
    hashes: list[bytes]
    children: set[int] = field(default_factory=set)
    serves: bool = True


class ReplicaIndex:
    """One replica's servable tree, as far as its messages have been applied."""

    def __init__(self) -> None:
        self.epoch: str | None = None  # None: cleared, waiting for a snapshot
        self.seq = 0
        self.block = 0  # tokens per hashed block, from the snapshot
        self.nodes: dict[int, _Node] = {}
        self.present: dict[bytes, int] = {}  # block hash -> nodes whose blocks include it
        self.ends: dict[bytes, int] = {}  # the last hash of a node that serves -> the node
        self.gaps = 0  # times the index was cleared for a gap, an epoch or garbage

    @property
    def ready(self) -> bool:
        return self.epoch is not None

    def apply(self, raw: bytes) -> bool:
        """Apply one cache message; True if the index was cleared and wants a snapshot."""
        try:
            msg = CACHE_MESSAGES.decode(raw)
        except WireError as err:
            log.error("a cache message refused (%s); index cleared", err)
            return self._lost()
        if isinstance(msg, CacheSnapshot):
            self.clear()
            self.epoch, self.seq, self.block = msg.epoch, msg.seq, msg.block
            for op in msg.ops:
                self._stored(op)
            return False
        if self.epoch is None:
            return False  # a snapshot is on its way: nothing before it can be applied
        if msg.epoch == self.epoch and msg.seq <= self.seq:
            return False  # a duplicate
        if msg.epoch != self.epoch or msg.seq != self.seq + 1:
            return self._lost()
        self.seq = msg.seq
        for op in msg.ops:
            if isinstance(op, Stored):
                self._stored(op)
            else:
                self._removed(op.node)
        return False

    def clear(self) -> None:
        self.epoch, self.seq = None, 0
        self.nodes, self.present, self.ends = {}, {}, {}

    def _lost(self) -> bool:
        self.gaps += 1
        self.clear()
        return True

    def _stored(self, op: Stored) -> None:
        hashes = op.hash_list()
        self.nodes[op.node] = _Node(op.parent, hashes)
        parent = self.nodes.get(op.parent)
        if parent is not None:
            parent.children.add(op.node)
        present = self.present
        for h in hashes:
            present[h] = present.get(h, 0) + 1
        self.ends[hashes[-1]] = op.node

    def _removed(self, node_id: int) -> None:
        node = self.nodes.get(node_id)
        if node is None or not node.serves:
            return
        node.serves = False
        if self.ends.get(node.hashes[-1]) == node_id:
            del self.ends[node.hashes[-1]]
        self._prune(node_id)

    def _prune(self, node_id: int) -> None:
        """Forget a node that no longer serves and carries no node below, then its parent
        if that is left the same."""
        while (node := self.nodes.get(node_id)) is not None:
            if node.serves or node.children:
                return
            del self.nodes[node_id]
            for h in node.hashes:
                left = self.present[h] - 1
                if left:
                    self.present[h] = left
                else:
                    del self.present[h]
            parent = self.nodes.get(node.parent)
            if parent is not None:
                parent.children.discard(node_id)
            node_id = node.parent


class PrefixIndex:
    """Every replica's index, by replica id."""

    def __init__(self) -> None:
        self.replicas: dict[str, ReplicaIndex] = {}

    def replica(self, replica_id: str) -> ReplicaIndex:
        return self.replicas.setdefault(replica_id, ReplicaIndex())

    def cached_tokens(self, replica_id: str) -> int:
        """How many tokens of distinct blocks the index holds for a replica (0 while it
        waits for a snapshot): the size of its cache, to send a prompt that no replica
        holds to the emptiest cache."""
        index = self.replicas.get(replica_id)
        return len(index.present) * index.block if index is not None and index.ready else 0

    def match(
        self, tokens: Sequence[int], among: Iterable[str], namespace: str = ""
    ) -> dict[str, int]:
        """Per replica of `among`, how many of `tokens` its cache would serve in
        `namespace`: the longest prefix, short of the last token (a request computes at
        least that one), ending where a node serves. Hashes only as far as some replica
        still has the blocks."""
        found: dict[str, int] = {}
        by_block: dict[int, dict[str, ReplicaIndex]] = {}
        for rid in among:
            index = self.replicas.get(rid)
            if index is not None and index.ready:
                by_block.setdefault(index.block, {})[rid] = index
        head = np.asarray(tokens[: len(tokens) - 1], dtype=np.int64)
        for block, walking in by_block.items():
            for n, h in enumerate(block_hashes(head, block, namespace_root(namespace)), 1):
                for rid, index in list(walking.items()):
                    if h not in index.present:
                        del walking[rid]
                    elif h in index.ends:
                        found[rid] = n * block
                if not walking:
                    break
        return found


class IndexCollector:
    """The index's size and state per replica, as metrics of the front (`router`,
    `epp`) that keeps it."""

    def __init__(self, index: PrefixIndex, front: str) -> None:
        self.index, self.front = index, front

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        blocks = GaugeMetricFamily(
            f"custody_{self.front}_prefix_blocks",
            "distinct token blocks the router's index holds of a replica's prefix cache",
            labels=["replica"],
        )
        ready = GaugeMetricFamily(
            f"custody_{self.front}_prefix_index_ready",
            "1 once the index of a replica's cache is built (0 while it waits for a snapshot)",
            labels=["replica"],
        )
        cleared = CounterMetricFamily(
            f"custody_{self.front}_prefix_index_cleared",
            "times the index of a replica's cache was cleared for a gap, a new epoch or a "
            "message that did not decode, and a snapshot asked for",
            labels=["replica"],
        )
        for rid, replica in self.index.replicas.items():
            blocks.add_metric([rid], len(replica.present))
            ready.add_metric([rid], float(replica.ready))
            cleared.add_metric([rid], replica.gaps)
        yield blocks
        yield ready
        yield cleared
