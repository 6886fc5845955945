"""Making room in the pools for what a step needs, under memory pressure: evict from the
prefix cache first, then drop the device state of idle sessions, least recently used
first (their next turn re-prefills their history). Retracting running requests is the
core's last resort, since only it knows which requests the step has planned."""

from __future__ import annotations

import logging

from services.scheduler.allocators.pools import Pools
from services.scheduler.cache.radix_cache import RadixCache
from services.scheduler.sessions.manager import SessionManager

log = logging.getLogger("custody.engine")


def make_room(
    pools: Pools, cache: RadixCache, sessions: SessionManager, pages: int, mamba: int, rows: int
) -> bool:
    """Make `pages` KV pages, `mamba` slots and `rows` rows free; False if even dropping
    every idle session's state would not."""

    def short() -> bool:
        return (
            pages > pools.kv_pages.free_count
            or mamba > pools.mamba.free_count
            or rows > pools.req.free_count
        )

    while short():
        if pages > pools.kv_pages.free_count:
            cache.evict_kv(pages - pools.kv_pages.free_count)
        if mamba > pools.mamba.free_count:
            cache.evict_mamba(mamba - pools.mamba.free_count)
        if short():
            log.info(
                "short of room: need %d pages (%d free), %d mamba (%d), %d rows (%d)",
                pages,
                pools.kv_pages.free_count,
                mamba,
                pools.mamba.free_count,
                rows,
                pools.req.free_count,
            )
            if not sessions.drop_idle_state():
                return False
    return True
