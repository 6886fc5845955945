"""How a request leaves the running list: it finishes (its state goes to its session or
the prefix cache), it is aborted, or it is retracted (re-queued at the front). Every path
first drops the request's rows still in flight (`InFlight.unplan`), so their effects
never count."""

from __future__ import annotations

from collections import Counter

from services.scheduler.allocators.pools import Pools
from services.scheduler.cache.radix_cache import RadixCache
from services.scheduler.engine.config import EngineConfig
from services.scheduler.engine.in_flight import InFlight
from services.scheduler.engine.queue import RequestQueue
from services.scheduler.engine.room import Room
from services.scheduler.records.finish import FinishReason
from services.scheduler.records.request import Request, Status
from services.scheduler.sessions.manager import SessionManager


class Endings:
    def __init__(
        self,
        pools: Pools,
        cache: RadixCache,
        sessions: SessionManager,
        in_flight: InFlight,
        queue: RequestQueue,
        room: Room,
        config: EngineConfig,
    ) -> None:
        self.pools, self.cache, self.sessions = pools, cache, sessions
        self.in_flight, self.queue, self.room = in_flight, queue, room
        self.checkpoint_interval = config.checkpoint_interval
        self.retractions = 0
        # states cached at a request's junction, and at the periodic checkpoints
        self.checkpoints: Counter[str] = Counter()

    def finish(self, req: Request) -> None:
        """`req` sampled its last token: its state goes to its session, else (or if the
        session could not keep it) its latest snapshot to the cache and the rest back."""
        req.status = Status.FINISHED
        self._stop(req)
        if req.session is None or not self.sessions.save(req, self.cache_prefix):
            self.cache_prefix(req)
            req.release(self.pools, self.cache)
        req.slots = None
        del self.queue.by_rid[req.rid]

    def abort(self, rid: str, reason: str) -> list[Request]:
        """Abort `rid` now, running or not (its rows still in flight are dropped).
        Returns the requests that ended now."""
        req = self.queue.by_rid.get(rid)
        if req is None or req.done:
            return []
        req.abort_reason = reason
        if req.status is Status.WAITING:
            self.queue.waiting.remove(req)
        else:
            self._stop(req)
            if req.session is None:
                req.release(self.pools, self.cache)
        if req.session is not None and req.session.turn is req:
            self.sessions.rollback(req, keep_turn=False)
        req.status = Status.ABORTED
        req.finish_reason = FinishReason("abort", message=req.abort_reason)
        req.slots = None
        self.queue.by_rid.pop(req.rid, None)
        return [req]

    def retract(self, req: Request) -> None:
        """Preempt a running request: give back everything, re-queue it at the front."""
        self._stop(req)
        if req.session is not None:
            self.sessions.rollback(req, keep_turn=True)
        else:
            req.release(self.pools, self.cache)
            req.slots, req.computed = None, 0
        req.status = Status.WAITING
        self.queue.waiting.appendleft(req)
        self.retractions += 1

    def cache_prefix(self, req: Request) -> None:
        """Donate the deepest snapshot on a page boundary (the latest, or the one before
        a chat turn's reply start, which lies inside a page as a rule), and the KV up to
        it, to the prefix cache. A request's borrowed prefix grows to what the tree holds,
        under one lock on the deepest node (a session's turn keeps that lock for its
        session, `save`)."""
        track, ps = req.slots.track, self.pools.config.page_size
        snap = track.deepest_on_page(ps)
        if snap is None or snap.seq_len <= req.slots.borrowed:
            return
        if not self.room.make(0, 1, 0, drop_sessions=False):  # the track refills the donated slot
            return
        row = req.slots.row.slot
        node, tree_pages = self.cache.insert(
            req.sequence[: snap.seq_len],
            self.pools.rows.row_pages(row, 0, snap.seq_len),
            req.slots.owner,
            lambda receiver: track.donate(snap, receiver).slot,
            req.cache_namespace,
        )
        interval = self.checkpoint_interval
        if snap.seq_len == req.checkpoint:
            self.checkpoints["junction"] += 1
        elif interval and snap.seq_len % interval == 0:
            self.checkpoints["interval"] += 1
        self.pools.kv.adopt_prefix(row, tree_pages)
        req.slots.borrowed = len(tree_pages) * ps
        self.cache.lock(node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = node

    def _stop(self, req: Request) -> None:
        """Take a running request off the running list; rows it still has in flight are
        dropped (their writes land in slots and positions that no longer count)."""
        self.queue.running.remove(req)
        self.in_flight.unplan(req)
