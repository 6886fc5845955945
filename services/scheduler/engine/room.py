"""Making room in the pools for what a step needs, under memory pressure: evict from the
prefix cache first, then move off the device the state of sessions no turn is running
on (idle ones, and those whose turn still waits), least recently used first (hibernated
to the host tier, or dropped if the tiers cannot take it: then their next turn
re-prefills their history). A waiting turn's session counts: else a request that needs
its room waits for ever at the head of the queue, in front of the turn that cannot start
before it. Retracting running requests is the
core's last resort, since only it knows which requests the step has planned.

A session's state is worth far more than a cache entry (its next turn costs only its new
tokens), so it is dropped only for an admission, never to make room for a speculative
cache donation, and only when dropping could make the admission fit: before dropping
any, what is free, what idle sessions own and what the cache could give up once they
stop borrowing from it are added up per pool; if that falls short, nothing is dropped.
(For Mamba slots every cache state counts, though a state on a borrowed leaf cannot go:
an upper bound, so in that rare case sessions may be dropped and the admission still
waits.)
"""

from __future__ import annotations

import logging

from services.scheduler.allocators.pools import Pools
from services.scheduler.cache.node import CacheNode
from services.scheduler.cache.radix_cache import RadixCache
from services.scheduler.records.session import Session
from services.scheduler.sessions.manager import SessionManager

log = logging.getLogger("custody.engine")


class Room:
    """Frees pool room on demand; admission, planning and the cache's donations share it."""

    def __init__(self, pools: Pools, cache: RadixCache, sessions: SessionManager) -> None:
        self.pools, self.cache, self.sessions = pools, cache, sessions

    def make(
        self,
        pages: int,
        mamba: int,
        rows: int,
        drop_sessions: bool = True,
        keep: Session | None = None,
    ) -> bool:
        """Make `pages` KV pages, `mamba` slots and `rows` rows free; False (having
        dropped no session state) if that cannot be done. Without `drop_sessions`, only
        the cache gives way; `keep` is the session whose turn the room is for."""
        pools, cache = self.pools, self.cache
        wanted = ((pools.kv_pages, pages), (pools.mamba, mamba), (pools.req, rows))
        if all(n <= pool.free_count for pool, n in wanted):
            return True  # the common case, every step of every running request

        def short() -> bool:
            return any(n > pool.free_count for pool, n in wanted)

        def evict() -> None:
            if pages > pools.kv_pages.free_count:
                cache.evict_kv(pages - pools.kv_pages.free_count)
            if mamba > pools.mamba.free_count:
                cache.evict_mamba(mamba - pools.mamba.free_count)

        evict()
        if not short():
            return True
        if not drop_sessions or not self._sessions_could_cover(wanted, keep):
            return False
        while short():
            log.info(
                "short of room: need %d pages (%d free), %d mamba (%d), %d rows (%d)",
                pages,
                pools.kv_pages.free_count,
                mamba,
                pools.mamba.free_count,
                rows,
                pools.req.free_count,
            )
            if not self.sessions.evict_idle(keep):
                return False
            evict()
        return True

    def _idle_state_held(self, keep: Session | None) -> tuple[dict[str, int], list[CacheNode]]:
        """What dropping the state of every session but `keep` that no turn uses would
        give back: the slots they own per pool, and the cache nodes they borrow from
        (each one lock)."""
        held = {"kv": 0, "mamba": 0, "req": 0}
        borrowed = []
        for s in self.sessions.sessions.values():
            if s.state_in_use or s is keep:
                continue
            if s.slots is not None:
                for pool in (self.pools.kv_pages, self.pools.mamba, self.pools.req):
                    held[pool.name] += len(pool.owned_by(s.owner))
            if s.cache_node is not None:
                borrowed.append(s.cache_node)
        return held, borrowed

    def _sessions_could_cover(self, wanted: tuple, keep: Session | None) -> bool:
        held, borrowed = self._idle_state_held(keep)
        from_cache = {
            "kv": self.cache.reclaimable_pages(borrowed),
            "mamba": self.cache.reclaimable_states(borrowed),
            "req": 0,
        }
        for pool, n in wanted:
            reachable = pool.free_count + from_cache[pool.name] + held[pool.name]
            if n > reachable:
                log.info("no room for %d %s slots even without idle sessions' state", n, pool.name)
                return False
        return True
