"""The scheduling core: admission, batching, completion, abort and retract.

It owns the request queues and drives every other owner through its API: allocators,
the prefix cache and the sessions. `plan_step` decides what runs and moves slots
accordingly, the executor runs the plan, `complete_step` applies the result. The next
step may be planned while one is in flight (in_flight.py says why that is safe).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from services.scheduler.allocators.pools import Pools
from services.scheduler.cache.radix_cache import RadixCache
from services.scheduler.engine.admission import admit_waiting
from services.scheduler.engine.completion import complete
from services.scheduler.engine.config import EngineConfig
from services.scheduler.engine.faults import lose_device, refuse_step
from services.scheduler.engine.in_flight import InFlight
from services.scheduler.engine.room import make_room
from services.scheduler.engine.step import StepPlan
from services.scheduler.engine.step_builder import StepBudget, grow_kv, pages_to_grow, row_plan
from services.scheduler.engine.stopping import finish_reason, length_limit
from services.scheduler.engine.validation import check_prompt_length, check_tokens
from services.scheduler.ownership.invariants import (
    IntegrityReport,
    InvariantGuard,
    check_integrity,
)
from services.scheduler.records.finish import FinishReason
from services.scheduler.records.request import Request, Status
from services.scheduler.records.sampling import InvalidRequest, SamplingParams
from services.scheduler.records.session import ChatTurn
from services.scheduler.sessions.manager import SessionManager
from services.scheduler.text.output import OutputText
from shared.deferred_ops import DeferredOps
from shared.messages.forward import StepResult
from shared.messages.sampling import Top


class EngineCore:
    def __init__(
        self,
        pools: Pools,
        config: EngineConfig,
        strict: bool = True,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        config.check(pools.config)
        self.pools = pools
        self.config = config
        self.decode = decode  # the tokenizer's, for each request's output text
        self.cache = RadixCache(pools)
        self.sessions = SessionManager(
            pools, self.cache, limit=config.max_sessions, idle_timeout=config.idle_timeout
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.in_flight = InFlight(pools, self.cache)
        self.retractions = 0
        self.quarantined = 0  # requests failed as poison (faults.py)
        self.cache_queries = self.cache_hits = self.cache_hit_tokens = 0
        self.guard = InvariantGuard(strict)
        self._step_ids = itertools.count(1)

    # ---- intake ----
    def submit(self, req: Request) -> Request:
        """Queue a request; bad input is refused here, before anything is allocated."""
        req.prompt = check_tokens(req.prompt, self.config.vocab_size)
        req.params.validate(self.config.vocab_size)
        self._check_rid(req.rid)
        check_prompt_length(len(req.prompt), self.config.context_len)
        return self._queue(req)

    def submit_turn(
        self,
        sid: str,
        new_tokens: np.ndarray,
        rid: str,
        params: SamplingParams,
        session_params: dict | None = None,
        chat: ChatTurn | None = None,
        cache_namespace: str = "",
    ) -> Request:
        """Queue the next turn of session `sid` (the prompt becomes history + input; the
        session builds the request); `chat`: a chat turn's conversation."""
        tokens = check_tokens(new_tokens, self.config.vocab_size)
        params.validate(self.config.vocab_size)
        self._check_rid(rid)
        turn = self.sessions.begin_turn(
            sid, tokens, params, rid, self.config.context_len, session_params, chat, cache_namespace
        )
        return self._queue(turn)

    def _queue(self, req: Request) -> Request:
        """Queue a checked request, its output text to be detokenized incrementally."""
        if self.decode is not None:
            req.text = OutputText(self.decode, req.params.stop, not req.params.no_stop_trim)
        self.requests[req.rid] = req
        self.waiting.append(req)
        return req

    def abort(self, rid: str, reason: str = "aborted by request") -> list[Request]:
        """Abort `rid` now, running or not (its rows still in flight are dropped).
        Returns the requests that ended now."""
        req = self.requests.get(rid)
        if req is None or req.done:
            return []
        req.abort_reason = reason
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        else:
            self._stop(req)
            if req.session is None:
                req.release(self.pools, self.cache)
        return [self._end_aborted(req)]

    # ---- one step ----
    def plan_step(self) -> StepPlan | None:
        self.in_flight.check_room()
        self.sessions.expire()
        plan = StepPlan(next(self._step_ids), [], DeferredOps(), self.in_flight.last_step)
        self.sessions.tiers.advance_placements(self.make_room)
        self.sessions.tiers.prefetch(self.waiting)
        chosen: list[tuple[Request, int]] = []
        state = StepBudget(self.config.max_step_tokens)
        for req in list(self.running):
            if req in self.running:
                n = self._fit_running(req, chosen, state)
                if n:
                    chosen.append((req, n))
        while self.waiting and state.tokens > 0:
            n = admit_waiting(self, self.waiting[0], plan, state)
            if not n:
                break
            req = self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            chosen.append((req, n))
        plan.tier = self.sessions.moves.take()
        if not chosen and not plan.tier:
            return None
        grow_kv(self.pools, chosen)
        plan.rows = [row_plan(self.pools, self.config.track_interval, req, n) for req, n in chosen]
        self.in_flight.add(plan)
        return plan

    def complete_step(
        self,
        plan: StepPlan,
        sampled: dict[str, int],
        logprobs: dict[str, float] | None = None,
        failed_moves: set[int] | None = None,
        top: dict[str, Top] | None = None,
    ) -> list[Request]:
        """Apply the executor's result of `plan` (`failed_moves`: indices of its tier moves
        that did not happen; `top`: the top log probabilities of the rows that asked);
        returns the requests that ended."""
        self.in_flight.pop_oldest(plan)
        self.sessions.moves.landed(plan.tier, failed_moves or set())
        ended = []
        for row in plan.rows:
            if row.dropped:
                continue
            req = self.requests[row.rid]
            if req.inflight[0] is not row:
                raise RuntimeError(f"{row.rid}: rows completed out of order")
            req.inflight.pop(0)
            req.computed = row.end
            req.slots.state.commit(row.mamba_out)
            if row.snapshot_slot:
                req.slots.track.record(row.snapshot_slot, row.snapshot_len)
            if row.sample:
                token = int(sampled[row.rid])
                req.record(token, (logprobs or {}).get(row.rid), (top or {}).get(row.rid))
                req.finish_reason = finish_reason(
                    req, token, self.config.eos_token_ids, self.config.context_len
                )
                if req.finish_reason is not None:
                    self._finish(req)
                    ended.append(req)
                    continue
            start = req.turn_start
            fresh = start is None or (req.chat is not None and start.rollback is None)
            if row.snapshot_slot and row.prefill and fresh:
                # a chunk's state is reachable at once (scenario P6, docs/scenarios.md); a
                # chat turn's too when it has no rollback copy: a re-encoded reply needs it
                self._cache_prefix(req)
        return ended

    def complete(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Apply the executor's reply to `plan` (completion.py); returns the requests
        that ended."""
        return complete(self, plan, result)

    def step_refused(self, plan: StepPlan, error: str, ops_ran: bool = False) -> list[Request]:
        """The executor refused `plan` (faults.py); returns the requests that ended."""
        return refuse_step(self, plan, f"executor refused the step: {error}", ops_ran)

    def step_unsent(self, plan: StepPlan, error: str) -> list[Request]:
        """`plan` could not be put on the wire (faults.py); returns the requests that
        ended."""
        return refuse_step(self, plan, f"the step could not be sent: {error}", ops_ran=False)

    def device_lost(self, suspect: bool = True) -> list[Request]:
        """The executor's device state is gone (faults.py); returns the requests that
        ended (quarantined)."""
        return lose_device(self, suspect)

    # ---- views ----
    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.in_flight or self.sessions.tier_work)

    def audit(self) -> IntegrityReport:
        """The check the idle loop runs: raises when strict, else logs and counts."""
        return self.guard.judge(self.check())

    def check(self, *, idle: bool | None = None) -> IntegrityReport:
        """Every holder's claims against the ledger, plus the cache and row-table checks."""
        claims = [c for r in self.running for c in r.slots.claims(self.pools)]
        claims += self.sessions.claims() + self.cache.claims()
        claims += [c for plan in self.in_flight for c in plan.tier.claims()]
        report = check_integrity(
            self.pools.ledger, claims, idle=self.idle if idle is None else idle
        )
        report.problems += self.cache.problems() + self.pools.kv.integrity_problems()
        return report

    # ---- planning ----
    def _fit_running(self, req: Request, chosen: list, state: StepBudget) -> int:
        """Tokens `req` computes this step, after making KV room (evicting the cache, then
        retracting the newest unplanned requests); 0 if it cannot run now."""
        if req.awaits_token and length_limit(req, self.config.context_len, pending=1):
            return 0  # the token in flight is surely its last
        n = min(req.length + req.awaits_token - req.planned, self.config.chunk_size, state.tokens)
        if n <= 0:
            return 0
        need = pages_to_grow(self.pools.config.page_size, req.planned, n)
        planned = {id(r) for r, _ in chosen}
        while not self.make_room(need + state.pages, 0, 0):
            victims = [r for r in reversed(self.running) if r is not req and id(r) not in planned]
            if not victims:
                self.retract(req)
                return 0
            self.retract(victims[0])
        state.take(n, need)
        return n

    def make_room(self, pages: int, mamba: int, rows: int, drop_sessions: bool = True) -> bool:
        """Free what is needed, evicting the cache and dropping idle sessions' state
        (room.py); False if even that cannot."""
        return make_room(self.pools, self.cache, self.sessions, pages, mamba, rows, drop_sessions)

    def _check_rid(self, rid: str) -> None:
        if rid in self.requests:
            raise InvalidRequest(f"request id {rid} is already in use")

    # ---- endings ----
    def _stop(self, req: Request) -> None:
        """Take a running request off the running list; rows it still has in flight are
        dropped (their writes land in slots and positions that no longer count)."""
        self.running.remove(req)
        self.in_flight.unplan(req)

    def _finish(self, req: Request) -> None:
        req.status = Status.FINISHED
        self._stop(req)
        if req.session is None or not self.sessions.save(req):  # save: True if it kept them
            self._cache_prefix(req)
            req.release(self.pools, self.cache)
        req.slots = None
        del self.requests[req.rid]

    def _cache_prefix(self, req: Request) -> None:
        """Donate the latest snapshot, and the KV up to it, to the prefix cache."""
        track, ps = req.slots.track, self.pools.config.page_size
        snap = track.latest_snapshot()
        if snap is None or snap.seq_len <= req.slots.borrowed:
            return
        if not self.make_room(0, 1, 0, drop_sessions=False):  # the track refills the donated slot
            return
        row = req.slots.row.slot
        node, tree_pages = self.cache.insert(
            req.sequence[: snap.seq_len],
            self.pools.rows.row_pages(row, 0, snap.seq_len),
            req.slots.owner,
            lambda receiver: track.donate_latest(receiver).slot,
            req.cache_namespace,
        )
        self.pools.kv.adopt_prefix(row, tree_pages)
        req.slots.borrowed = len(tree_pages) * ps
        self.cache.lock(node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = node

    def _end_aborted(self, req: Request) -> Request:
        if req.session is not None and req.session.turn is req:
            self.sessions.rollback(req, keep_turn=False)
        req.status = Status.ABORTED
        req.finish_reason = FinishReason("abort", message=req.abort_reason)
        req.slots = None
        self.requests.pop(req.rid, None)
        return req

    def retract(self, req: Request) -> None:
        """Preempt a running request: give back everything, re-queue it at the front."""
        self._stop(req)
        if req.session is not None:
            self.sessions.rollback(req, keep_turn=True)
        else:
            req.release(self.pools, self.cache)
            req.slots, req.computed = None, 0
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.retractions += 1
