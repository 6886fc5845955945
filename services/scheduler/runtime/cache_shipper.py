"""Ships the prefix cache's servable tree to the routers (shared/messages/cache.py): a
snapshot at the start of the scheduler's epoch and whenever a router asks, then the
cache log's ops in batches. Numbered with a sequence of their own (the session store's
messages on the same stream have theirs), consecutive within the epoch, so a router that
misses one knows it and asks for a snapshot."""

from __future__ import annotations

from services.scheduler.cache.radix_cache import RadixCache
from shared.messages.cache import CacheEvents, CacheSnapshot
from shared.messages.envelope import encode


class CacheShipper:
    def __init__(self, cache: RadixCache, epoch: str) -> None:
        self.cache = cache
        self.log = cache.record_events()
        self.epoch = epoch
        self.seq = 0

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def batch(self) -> bytes | None:
        """The ops since the last call as one message; None if none."""
        ops = self.log.take()
        if not ops:
            return None
        return encode(CacheEvents(epoch=self.epoch, seq=self._next(), ops=ops))

    def snapshot(self) -> bytes:
        """The whole servable tree, the ops not yet shipped folded in."""
        ops = self.log.snapshot(self.cache.nodes())
        return encode(
            CacheSnapshot(epoch=self.epoch, seq=self._next(), block=self.log.block, ops=ops)
        )
