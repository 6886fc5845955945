"""Radix prefix cache over token ids, holding KV pages and Mamba states (page-aligned).

A match ends only where a node holds a state, because a hybrid model needs both the KV
of the prefix and the Mamba state at its end. A request that matches gets a fresh slot
and a deferred copy from the node's state; the node stays copy-locked until that copy
has run. Inserting donates the slot holding a request's latest snapshot (ownership
moves, nothing is copied). KV eviction takes unlocked leaves, least recently used first;
Mamba eviction takes the least recently used unlocked state anywhere, turning an inner
node into a tombstone, except that a junction's state (a node where two or more cached
prefixes part) goes only once no other state can: every request that shares the prefix
up to the junction resumes from it, a leaf's state serves one prompt. No unlocked leaf is
ever a tombstone.

Each node belongs to one namespace (shared/messages/cache.py: a key's, a salt's, or
everyone's), part of the label its parent files it under: a request matches only nodes of
its own namespace, so a hit, `cached_tokens` and latency tell it nothing of another
key's prompts, while eviction stays one LRU over the whole pool.

Both evictions take from indexes in recency order (lru.py), refiled wherever a node
changes, so that choosing what to evict never walks the tree. What eviction could free
right now (`evictable_pages`, `evictable_states`) is kept the same way, for the KV
utilisation a scrape reports (runtime/metrics.py) without a walk. Where a node gains or
loses a state, the cache's log (when on) records it for the routers (cache_log.py).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from services.scheduler.allocators.pools import Pools
from services.scheduler.cache.cache_log import CacheLog
from services.scheduler.cache.lru import LruIndex
from services.scheduler.cache.node import CacheNode
from services.scheduler.ownership.invariants import Claim
from services.scheduler.ownership.owners import Owner, OwnerKind
from shared.messages.cache import HASH_BYTES

Donate = Callable[[Owner], int]  # moves a state slot to the given owner, returns the slot


@dataclass(frozen=True)
class Match:
    node: CacheNode  # the root when nothing matched
    length: int
    pages: np.ndarray  # KV pages of positions [0, length)
    # positions whose KV the tree holds, state or not: past `length`, a state gap, which
    # a request closes by ending a chunk at `kv_length` and donating its state there
    kv_length: int = 0


class RadixCache:
    def __init__(self, pools: Pools) -> None:
        self.pools = pools
        self.ledger = pools.ledger
        self.page_size = pools.config.page_size
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        empty = np.zeros(0, dtype=np.int64)
        self.root = CacheNode(self._new_owner(), empty, empty, None, 0, kv_lock=1)
        self._kv_lru: LruIndex[CacheNode] = LruIndex(attrgetter("kv_time"))
        self._mamba_lru: LruIndex[CacheNode] = LruIndex(attrgetter("mamba_time"))
        self._junction_lru: LruIndex[CacheNode] = LruIndex(attrgetter("mamba_time"))
        self.log: CacheLog | None = None
        self.states_evicted = 0
        # pages of nodes nobody borrows with no copy pending at or below them: evict_kv
        # frees them all, leaves first; kept by `_pin`, `_grow` and `_remove`
        self.evictable_pages = 0

    def record_events(self) -> CacheLog:
        """Log changes from now on: on an empty tree, so every node is hashed once."""
        if self.root.children:
            raise RuntimeError("the cache's log starts on an empty tree")
        self.log = CacheLog(self.page_size)
        return self.log

    # ---- lookups ----
    def match(self, tokens: np.ndarray, limit: int, namespace: str = "") -> Match:
        """Longest prefix of `tokens` in `namespace`, at most `limit` long, with KV and a
        state at its end, and how far the KV alone reaches (whole pages, within a node
        where the prompt leaves the path). Refreshes KV recency along the path and Mamba
        recency of the state it uses."""
        node, best, pos, kv_length = self.root, self.root, 0, 0
        while pos < limit:
            child = node.children.get(self._label(namespace, tokens, pos))
            if child is None:
                break
            common = self._common(child.key, tokens[pos:limit])
            if common < len(child.key):  # the prompt, or the limit, leaves the path here
                kv_length = pos + common
                break
            node, pos = child, child.end
            kv_length = pos
            if child.mamba:
                best = child
        path = best.path()
        now = next(self._clock)
        for n in path:
            n.kv_time = now
        best.mamba_time = now
        self._index(best)  # of the path, only `best` can be a leaf
        pages = np.concatenate([n.pages for n in path]) if path else self.root.pages
        return Match(best, best.end, pages, kv_length)

    # ---- insertion ----
    def insert(
        self,
        tokens: np.ndarray,
        pages: np.ndarray,
        giver: Owner,
        donate: Donate | None,
        namespace: str = "",
    ) -> tuple[CacheNode, np.ndarray]:
        """Cache `tokens` (page-aligned) in `namespace`, whose KV is `pages`, with the state
        at their end given by `donate` when the tree has none there. Positions the tree
        already holds keep the tree's pages; `giver` keeps its own copies of them, to free
        (see PagedKV.adopt_prefix). Returns the end node and the tree's pages for `tokens`.
        Without `donate`, nothing past the existing tree is added (no stateless leaf)."""
        self._check_aligned("insert", tokens, pages)
        now = next(self._clock)
        node, pos = self._descend(tokens, namespace, now)
        if pos < len(tokens) and donate is not None:

            def fill(leaf: CacheNode) -> None:
                leaf.mamba = donate(leaf.owner)  # first: if it fails, nothing else has moved
                leaf.mamba_time = now
                self.pools.kv_pages.transfer(leaf.pages, giver, leaf.owner, "insert")

            node = self._grow(node, tokens, pages, pos, now, namespace, fill)
            if self.log is not None:
                self.log.stored(node)
        elif donate is not None and node is not self.root and not node.mamba:
            node.mamba = donate(node.owner)
            node.mamba_time = now
            if self.log is not None:
                self.log.stored(node)
        self._index(node)
        path = node.path()
        tree_pages = np.concatenate([n.pages for n in path]) if path else self.root.pages
        return node, tree_pages

    def adopt(self, tokens: np.ndarray, pages: np.ndarray, namespace: str) -> CacheNode:
        """After a restart: the path of `tokens` (page-aligned) in `namespace`, whose KV
        the free `pages` still hold, for a session that borrowed it before; returned
        locked for that session. Where the tree has the path already (another session
        of the same prefix adopted it first), its pages must be these. The part it lacks
        becomes a tombstone leaf: no state is known there, and it goes with its last lock."""
        ps = self.page_size
        self._check_aligned("adopt", tokens, pages)
        now = next(self._clock)
        node, pos = self._descend(tokens, namespace, now)
        held = np.concatenate([n.pages for n in node.path()]) if pos else self.root.pages
        if not np.array_equal(held, pages[: pos // ps]):
            raise ValueError(f"adopt: the tree holds other pages for these {pos} positions")
        if pos < len(tokens):

            def fill(leaf: CacheNode) -> None:
                self.pools.kv_pages.take(leaf.pages, leaf.owner, "rebuild")

            node = self._grow(node, tokens, pages, pos, now, namespace, fill)
        self.lock(node)
        return node

    def _grow(
        self,
        parent: CacheNode,
        tokens: np.ndarray,
        pages: np.ndarray,
        pos: int,
        now: int,
        namespace: str,
        fill: Callable[[CacheNode], None],
    ) -> CacheNode:
        """A new leaf under `parent` for `tokens[pos:]` and their pages, given what it
        holds by `fill` before it joins the tree: if `fill` fails, the tree is as it was
        (and its owner is retired, loudly if `fill` moved anything to it first)."""
        leaf = CacheNode(
            self._new_owner(),
            tokens[pos:].copy(),
            pages[pos // self.page_size :].copy(),
            parent,
            len(tokens),
            kv_time=now,
            namespace=namespace,
        )
        try:
            fill(leaf)
        except BaseException:
            self.ledger.retire(leaf.owner)
            raise
        parent.children[self._label_of(leaf)] = leaf
        self.evictable_pages += len(leaf.pages)  # unlocked until its taker locks it
        self._index(parent)  # no longer a leaf
        return leaf

    def _descend(self, tokens: np.ndarray, namespace: str, now: int) -> tuple[CacheNode, int]:
        """Down the path of `tokens` (page-aligned) as far as the tree holds it, the node
        it leaves part-way split there; (the last node, its end). Refreshes KV recency."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(self._label(namespace, tokens, pos))
            if child is None:
                break
            child.kv_time = now
            self._index(child)  # a leaf, or the lower half of the split below
            common = self._common(child.key, tokens[pos:])
            if common < len(child.key):
                child = self._split(child, common)
            node, pos = child, child.end
        return node, pos

    def _check_aligned(self, what: str, tokens: np.ndarray, pages: np.ndarray) -> None:
        ps = self.page_size
        if len(tokens) % ps or len(pages) * ps != len(tokens):
            raise ValueError(f"{what}: {len(tokens)} tokens, {len(pages)} pages of {ps}")

    def _split(self, node: CacheNode, at: int) -> CacheNode:
        """Cut `node` after `at` tokens; the new upper half is a tombstone. Neither half
        changes in the indexes: the upper one is inner and stateless."""
        ps = self.page_size
        parent = node.parent
        upper = CacheNode(
            self._new_owner(),
            node.key[:at],
            node.pages[: at // ps],
            parent,
            node.start + at,
            kv_lock=node.kv_lock,
            copies_below=node.copies_below,  # pinned as `node` is: the evictable count stands
            kv_time=node.kv_time,
            hashes=node.hashes[: at // ps * HASH_BYTES],
            namespace=node.namespace,
        )
        self.pools.kv_pages.transfer(upper.pages, node.owner, upper.owner, "split")
        node.key, node.pages, node.parent = node.key[at:], node.pages[at // ps :], upper
        node.hashes = node.hashes[at // ps * HASH_BYTES :]
        parent.children[self._label_of(upper)] = upper
        upper.children[self._label_of(node)] = node
        return upper

    # ---- locks ----
    def lock(self, node: CacheNode) -> None:
        for n in node.path():
            self._pin(n, kv=1)
        self._index(node)  # of the path, only `node` can be a leaf

    def unlock(self, node: CacheNode) -> None:
        for n in node.path():
            if n.kv_lock <= 0:
                raise RuntimeError(f"unlock of unlocked {n}")
            self._pin(n, kv=-1)
        self._index(node)
        self._prune(node)

    def lock_copy(self, node: CacheNode) -> None:
        node.copy_lock += 1
        for n in node.path():
            self._pin(n, copies=1)
        self._index(node)

    def unlock_copy(self, node: CacheNode) -> None:
        if node.copy_lock <= 0:
            raise RuntimeError(f"copy unlock of {node} without a copy lock")
        node.copy_lock -= 1
        for n in node.path():
            self._pin(n, copies=-1)
        self._index(node)
        self._prune(node)

    def _pin(self, node: CacheNode, kv: int = 0, copies: int = 0) -> None:
        """Add `kv` borrowers through `node` and `copies` copy locks at or below it: the
        one place a node in the tree starts or stops pinning its pages, so the count of
        evictable pages follows without a walk."""
        was = self._pinned(node)
        node.kv_lock += kv
        node.copies_below += copies
        if self._pinned(node) != was:
            self.evictable_pages += len(node.pages) if was else -len(node.pages)

    @staticmethod
    def _pinned(node: CacheNode) -> bool:
        """Its pages stay: borrowed, or a copy pending at or below keeps it from ever
        becoming a leaf (a borrower below borrows through it too)."""
        return node.kv_lock > 0 or node.copies_below > 0

    # ---- eviction ----
    def evict_kv(self, pages: int) -> int:
        """Free at least `pages` KV pages from unlocked leaves, LRU first; returns freed.
        Any node left an unlocked leaf may go in the same call, even above pruned
        tombstones. Equal stamps (both halves of a split) go in the order filed."""
        freed = 0
        while freed < pages and (node := self._kv_lru.oldest()) is not None:
            parent = node.parent
            freed += self._remove(node)
            freed += self._prune(parent)
        return freed

    def evict_mamba(self, states: int) -> int:
        """Free `states` Mamba states, LRU first; a leaf goes whole. Returns freed."""
        freed = 0
        while freed < states and (node := self._oldest_state()) is not None:
            self.evict_state(node)
            freed += 1
        return freed

    def _oldest_state(self) -> CacheNode | None:
        """The state to evict next: the least recently used, junctions' last."""
        node = self._mamba_lru.oldest()
        return node if node is not None else self._junction_lru.oldest()

    def evict_state(self, node: CacheNode) -> None:
        """Free `node`'s Mamba state: a leaf goes whole, an inner node keeps its KV."""
        if node.is_leaf:
            parent = node.parent
            self._remove(node)
            self._prune(parent)
        else:
            self.pools.mamba.free_one(node.mamba, node.owner, "evict")
            self.states_evicted += 1
            node.mamba = 0
            self._index(node)
            if self.log is not None:
                self.log.removed(node)

    def _kv_evictable(self, node: CacheNode) -> bool:
        """An unlocked leaf still in the tree (the root has no parent either)."""
        return node.parent is not None and node.is_leaf and not node.kv_lock and not node.copy_lock

    def _mamba_evictable(self, node: CacheNode) -> bool:
        """A state no copy waits on, where freeing it takes no borrowed KV with it."""
        return bool(node.mamba) and not node.copy_lock and not (node.is_leaf and node.kv_lock)

    def _index(self, node: CacheNode) -> None:
        """Refile `node` in both eviction indexes after a change to it."""
        self._kv_lru.update(node, self._kv_evictable(node))
        evictable, junction = self._mamba_evictable(node), len(node.children) > 1
        self._mamba_lru.update(node, evictable and not junction)
        self._junction_lru.update(node, evictable and junction)

    def _remove(self, node: CacheNode) -> int:
        if node.mamba:
            self.pools.mamba.free_one(node.mamba, node.owner, "evict")
            self.states_evicted += 1
            node.mamba = 0
            if self.log is not None:
                self.log.removed(node)
        self.pools.kv_pages.free(node.pages, node.owner, "evict")
        self.evictable_pages -= len(node.pages)  # only an unpinned leaf is removed
        parent = node.parent
        del parent.children[self._label_of(node)]
        node.parent = None  # marks it removed
        self._index(node)
        self._index(parent)  # it may be a leaf now
        self.ledger.retire(node.owner)
        return len(node.pages)

    def _prune(self, node: CacheNode) -> int:
        """Remove unlocked tombstone leaves from `node` upwards; returns pages freed."""
        freed = 0
        while self._kv_evictable(node) and not node.mamba:
            parent = node.parent
            freed += self._remove(node)
            node = parent
        return freed

    # ---- views for checks and metrics ----
    def nodes(self) -> Iterator[CacheNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def claims(self) -> list[Claim]:
        out: list[Claim] = []
        for n in self.nodes():
            out.append((n.owner, "kv", n.pages))
            if n.mamba:
                out.append((n.owner, "mamba", [n.mamba]))
        return out

    def sizes(self) -> dict[str, int]:
        """Pages evictable and protected (locked), and states held: derived by a walk."""
        sizes = {"evictable_pages": 0, "protected_pages": 0, "states": 0}
        for n in self.nodes():
            sizes["protected_pages" if n.kv_lock else "evictable_pages"] += len(n.pages)
            sizes["states"] += bool(n.mamba)
        return sizes

    @property
    def evictable_states(self) -> int:
        """States evict_mamba could free right now: the members of its two indexes."""
        return len(self._mamba_lru) + len(self._junction_lru)

    def reclaimable_pages(self, released: list[CacheNode]) -> int:
        """KV pages eviction could free once each node in `released` has one borrower
        fewer: pages of nodes nobody else borrows, with no copy pending on them or below
        (a pinned node keeps its ancestors from ever becoming leaves). A walk of the whole
        tree: for decisions under memory pressure, not for the hot path."""
        gone = Counter(n for node in released for n in node.path())
        pinned: set[CacheNode] = set()
        pages = 0
        for n in reversed(list(self.nodes())):  # children before their parents
            below = any(c in pinned for c in n.children.values())
            if below or n.copy_lock or n.kv_lock > gone[n]:
                pinned.add(n)
            else:
                pages += len(n.pages)
        return pages

    def reclaimable_states(self, released: list[CacheNode]) -> int:
        """Mamba states eviction could free once each node in `released` has one borrower
        fewer: as `evict_mamba` may (no copy waits on it, and a leaf's only if nobody else
        borrows its KV). A state a running request pins, on the leaf it locks, is not one.
        A walk of the whole tree: for decisions under memory pressure."""
        gone = Counter(n for node in released for n in node.path())
        return sum(
            1
            for n in self.nodes()
            if n.mamba and not n.copy_lock and not (n.is_leaf and n.kv_lock > gone[n])
        )

    def problems(self) -> list[str]:
        """Structural invariants of the tree, and the eviction indexes and the evictable
        counts against a walk: a count that drifted would misreport the load."""
        out = []
        for n in self.nodes():
            if len(n.key) % self.page_size or len(n.pages) * self.page_size != len(n.key):
                out.append(f"{n}: key of {len(n.key)} tokens with {len(n.pages)} pages")
            if n.end != n.parent.end + len(n.key):
                out.append(f"{n}: end {n.end} != parent end + edge")
            if n.parent is not self.root and n.namespace != n.parent.namespace:
                out.append(f"{n}: namespace {n.namespace!r} under {n.parent.namespace!r}")
            if n.parent.children.get(self._label_of(n)) is not n:
                out.append(f"{n}: not reachable from its parent by its first page")
            if n.is_leaf and not n.mamba and not n.kv_lock and not n.copy_lock:
                out.append(f"{n}: an unlocked tombstone leaf")
            over_parent = n.parent is not self.root and n.kv_lock > n.parent.kv_lock
            if n.kv_lock < 0 or n.copy_lock < 0 or over_parent:
                out.append(f"{n}: lock counts inconsistent with parent {n.parent}")
            below = n.copy_lock + sum(c.copies_below for c in n.children.values())
            if n.copies_below != below:
                out.append(f"{n}: {n.copies_below} copy locks kept below, {below} found")
        kept = (self.evictable_pages, self.evictable_states)
        walked = (self.reclaimable_pages([]), self.reclaimable_states([]))
        if kept != walked:
            out.append(f"evictable (pages, states) kept as {kept}, {walked} by a walk")
        out += self._kv_lru.problems(n for n in self.nodes() if self._kv_evictable(n))
        states = [n for n in self.nodes() if self._mamba_evictable(n)]
        out += self._mamba_lru.problems(n for n in states if len(n.children) <= 1)
        out += self._junction_lru.problems(n for n in states if len(n.children) > 1)
        return out

    # ---- helpers ----
    def _new_owner(self) -> Owner:
        return self.ledger.new_owner(OwnerKind.CACHE, f"node{next(self._ids)}")

    def _label(self, namespace: str, tokens: np.ndarray, pos: int) -> tuple:
        """What a parent files a child under: its namespace and its first page."""
        return (namespace, *tokens[pos : pos + self.page_size].tolist())

    def _label_of(self, node: CacheNode) -> tuple:
        return self._label(node.namespace, node.key, 0)

    def _common(self, a: np.ndarray, b: np.ndarray) -> int:
        """Length of the common prefix of `a` and `b`, rounded down to whole pages."""
        n = min(len(a), len(b))
        diff = np.flatnonzero(a[:n] != b[:n])
        common = int(diff[0]) if len(diff) else n
        return common - common % self.page_size
