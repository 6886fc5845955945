"""Admission: what a waiting request takes when it starts running. A session turn whose
session holds state takes that state over (with a rollback copy), first brought back to
the device if it was hibernated; any other request
matches the prefix cache, borrows the matched KV pages and copies the matched Mamba state
into a fresh working slot (a deferred copy whose source stays locked until it ran), or
starts from a cleared slot."""

from __future__ import annotations

from services.scheduler.allocators.pools import Pools
from services.scheduler.allocators.request_slots import admit
from services.scheduler.cache.radix_cache import RadixCache
from services.scheduler.engine.config import EngineConfig
from services.scheduler.engine.room import Room
from services.scheduler.engine.step import StepPlan
from services.scheduler.engine.step_builder import StepBudget, cut_at_checkpoint, pages_to_grow
from services.scheduler.records.request import Request
from services.scheduler.records.session import TurnStart
from services.scheduler.sessions.manager import SessionManager


class Admission:
    def __init__(
        self,
        pools: Pools,
        cache: RadixCache,
        sessions: SessionManager,
        room: Room,
        config: EngineConfig,
    ) -> None:
        self.pools, self.cache, self.sessions, self.room = pools, cache, sessions, room
        self.chunk_size, self.checkpoint_interval = config.chunk_size, config.checkpoint_interval
        self.junctions = config.junctions
        self.cache_queries = self.cache_hits = self.cache_hit_tokens = 0
        # positions whose KV the cache held at admission, and of those the ones past the
        # deepest state (a state gap: KV there, no state to resume from; a junction is
        # then planned, so the next request finds the state)
        self.kv_matched_tokens = self.state_gap_tokens = 0

    def admit(self, req: Request, plan: StepPlan, state: StepBudget) -> int:
        """Take what `req` needs and queue its state ops; 0 (nothing taken) if it does not
        fit. Every path out of here either keeps all it took or gives all back (lesson 7,
        docs/ownership.md)."""
        session = req.session
        below = session is not None and session.state_tier in ("host", "disk")
        if below and not self._state_to_device(req, state):
            return 0
        page_size = self.pools.config.page_size
        if session is not None and session.slots is not None:
            n = self._chunk(req, session.cached_len, state)
            need = pages_to_grow(page_size, session.cached_len, n)
            if not self.room.make(
                need + state.pages, self.pools.config.request_mamba_slots, 0, keep=session
            ):
                return 0
            req.slots = self.sessions.restore(req, plan.ops)
            req.score_inputs(len(session.history))  # its new input: the history is not computed
            state.take(n, need)
            return n
        match = self.cache.match(req.sequence, req.reusable, req.cache_namespace)
        node = match.node if match.length else None
        if node is not None:
            self.cache.lock(node)
            self.cache.lock_copy(node)  # the copy source survives any eviction below
        gap = match.kv_length - match.length
        req.checkpoint = match.kv_length if gap > 0 and self.junctions else 0
        n = self._chunk(req, match.length, state)
        need = pages_to_grow(page_size, match.length, n)  # match: page-aligned
        if not self.room.make(need + state.pages, self.pools.config.request_mamba_slots, 1):
            if node is not None:
                self.cache.unlock_copy(node)
                self.cache.unlock(node)
            return 0
        req.slots = admit(self.pools, req.rid)
        self.cache_queries += 1
        self.cache_hits += bool(match.length)
        self.cache_hit_tokens += match.length
        self.kv_matched_tokens += match.kv_length
        self.state_gap_tokens += max(gap, 0)
        working = req.slots.state.current.slot
        if node is not None:
            self.pools.kv.borrow(req.slots.row.slot, match.pages)
            req.slots.borrowed = match.length
            plan.ops.copy(node.mamba, working, req.slots.owner.id)
            plan.copy_sources.append(node)
        else:
            plan.ops.clear(working, req.slots.owner.id)
        req.cache_node = node
        req.computed = req.cached_tokens = match.length
        req.score_inputs(match.length)
        if session is not None:
            req.turn_start = TurnStart(0, None)
        state.take(n, need)
        return n

    def _chunk(self, req: Request, start: int, state: StepBudget) -> int:
        """Positions `req` computes this step from `start`: a chunk, within the step's
        budget, ending at a checkpoint it would pass."""
        n = min(req.length - start, self.chunk_size, state.tokens)
        return cut_at_checkpoint(
            req, start, n, self.checkpoint_interval, self.pools.config.page_size
        )

    def _state_to_device(self, req: Request, state: StepBudget) -> bool:
        """A turn's session state is below the device: on a ready host state, start its
        restore (room for it and the turn's first chunk, made first); else it waits (a
        load or hibernate in flight)."""
        session = req.session
        n = self._chunk(req, session.cached_len, state)
        need = pages_to_grow(self.pools.config.page_size, session.cached_len, n)
        return self.sessions.tiers.bring_to_device(
            session, self.room.make, need + state.pages, self.pools.config.request_mamba_slots
        )
