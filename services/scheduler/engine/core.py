"""The scheduling core: intake, planning a step, and handing each outcome to the
collaborator that owns it.

It builds its collaborators once, each given exactly what it touches (the pools, the
prefix cache, the sessions, the in-flight table, the request queue): admission.py admits a
waiting request, completion.py applies a step that ran, faults.py a step that did not or a
lost device, endings.py ends and re-queues requests, room.py frees pool room. The core
calls them; none of them calls back into it. `plan_step` decides what runs and moves slots
accordingly, the executor runs the plan, `complete` applies the result. The next step may
be planned while one is in flight (in_flight.py says why that is safe).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator

import numpy as np

from services.scheduler.allocators.pools import Pools
from services.scheduler.cache.borrowers import Borrower, borrow_problems
from services.scheduler.cache.radix_cache import RadixCache
from services.scheduler.engine.admission import Admission
from services.scheduler.engine.completion import Completion
from services.scheduler.engine.config import EngineConfig
from services.scheduler.engine.drafts import Drafter, verifiable
from services.scheduler.engine.endings import Endings
from services.scheduler.engine.faults import Faults
from services.scheduler.engine.in_flight import InFlight
from services.scheduler.engine.queue import RequestQueue
from services.scheduler.engine.room import Room
from services.scheduler.engine.step import StepPlan
from services.scheduler.engine.step_builder import (
    StepBudget,
    awaits_track_slot,
    cut_at_checkpoint,
    grow_kv,
    pages_to_grow,
    row_plan,
)
from services.scheduler.engine.stopping import length_limit
from services.scheduler.engine.validation import (
    check_logprob_start,
    check_prompt_length,
    check_tokens,
)
from services.scheduler.ownership.invariants import (
    IntegrityReport,
    InvariantGuard,
    check_integrity,
)
from services.scheduler.records.request import ChatTurn, Request, Status
from services.scheduler.records.sampling import InvalidRequest, SamplingParams
from services.scheduler.records.session import Session
from services.scheduler.sessions.manager import SessionManager
from services.scheduler.text.output import OutputText
from shared.deferred_ops import DeferredOps
from shared.messages.forward import StepResult
from shared.session_ids import session_name
from shared.tokenizer import Tokenizer


class EngineCore:
    def __init__(
        self,
        pools: Pools,
        config: EngineConfig,
        strict: bool = True,
        tokenizer: Tokenizer | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        """`drafter`: where verify steps' drafts come from (drafts.py), with a
        speculative slot per draft in the pools; None: no speculation."""
        config.check(pools.config)
        self.drafter = drafter if pools.config.spec_slots else None
        self.pools = pools
        self.config = config
        self.tokenizer = tokenizer  # for each request's output text
        self.cache = RadixCache(pools)
        self.sessions = SessionManager(
            pools, self.cache, limit=config.max_sessions, idle_timeout=config.idle_timeout
        )
        self.queue = RequestQueue()
        self.in_flight = InFlight(pools, self.cache, self.sessions.records)
        self.room = Room(pools, self.cache, self.sessions)
        self.endings = Endings(
            pools, self.cache, self.sessions, self.in_flight, self.queue, self.room, config
        )
        self.admission = Admission(pools, self.cache, self.sessions, self.room, config)
        self.completion = Completion(
            self.queue,
            self.in_flight,
            self.sessions,
            self.endings,
            config.eos_token_ids,
            config.context_len,
        )
        self.faults = Faults(
            pools, self.cache, self.sessions, self.in_flight, self.queue, self.endings
        )
        self.guard = InvariantGuard(strict)
        self._step_ids = itertools.count(1)

    # ---- intake ----
    def submit(self, req: Request) -> Request:
        """Queue a request; bad input is refused here, before anything is allocated."""
        req.prompt = check_tokens(req.prompt, self.config.vocab_size)
        req.params.validate(self.config.vocab_size)
        self._check_rid(req.rid)
        check_prompt_length(len(req.prompt), self.config.context_len)
        check_logprob_start(req.params.logprob_start, len(req.prompt))
        return self._queue(req)

    def submit_turn(
        self,
        session: Session,
        new_tokens: np.ndarray,
        rid: str,
        params: SamplingParams,
        session_params: dict | None = None,
        chat: ChatTurn | None = None,
        cache_namespace: str = "",
    ) -> Request:
        """Queue the next turn of `session` (an open session, as `sessions.get` gives it:
        the prompt becomes history + input; the session builds the request); `chat`: a
        chat turn's conversation."""
        tokens = check_tokens(new_tokens, self.config.vocab_size)
        params.validate(self.config.vocab_size)
        self._check_rid(rid)
        check_logprob_start(params.logprob_start, len(session.history) + len(tokens))
        turn = self.sessions.begin_turn(
            session,
            tokens,
            params,
            rid,
            self.config.context_len,
            session_params,
            chat,
            cache_namespace,
        )
        return self._queue(turn)

    def _queue(self, req: Request) -> Request:
        """Queue a checked request, its output text to be detokenized incrementally."""
        if self.tokenizer is not None:
            trim = not req.params.no_stop_trim
            req.text = OutputText(self.tokenizer, req.params.stop, trim)
        self.queue.by_rid[req.rid] = req
        self.queue.waiting.append(req)
        return req

    def abort(self, rid: str, reason: str = "aborted by request") -> list[Request]:
        """Abort `rid` now, running or not (its rows still in flight are dropped).
        Returns the requests that ended now."""
        return self.endings.abort(rid, reason)

    def retract(self, req: Request) -> None:
        """Preempt a running request: give back everything, re-queue it at the front."""
        self.endings.retract(req)

    # ---- one step ----
    def plan_step(self) -> StepPlan | None:
        self.in_flight.check_room()
        self.sessions.expire()
        plan = StepPlan(next(self._step_ids), [], DeferredOps(), self.in_flight.last_step)
        self.sessions.tiers.advance_placements(self.room.make)
        self.sessions.tiers.prefetch(self.queue.waiting)
        chosen: list[tuple[Request, int]] = []
        drafts: dict[str, list[int]] = {}  # by request: the drafts its row verifies
        state = StepBudget(self.config.max_step_tokens)
        running, waiting = self.queue.running, self.queue.waiting
        retracted = self.endings.retractions
        for req in list(running):
            # a request retracted while this step is planned is no longer running
            if self.endings.retractions == retracted or req in running:
                n = self._fit_running(req, chosen, state, drafts)
                if n:
                    chosen.append((req, n))
        while waiting and state.tokens > 0:
            n = self.admission.admit(waiting[0], plan, state)
            if not n:
                break
            req = waiting.popleft()
            req.status = Status.RUNNING
            req.grammar_started = False  # its first sampling row starts the matcher
            running.append(req)
            chosen.append((req, n))
        plan.tier = self.sessions.moves.take()
        if not chosen and not plan.tier:
            return None
        grow_kv(self.pools, chosen)
        interval, step = self.config.track_interval, plan.step_id
        plan.rows = [
            row_plan(
                self.pools, interval, req, n, step, drafts.get(req.rid, ()), self._feeds_head(req)
            )
            for req, n in chosen
        ]
        self.in_flight.add(plan)
        return plan

    def complete_step(self, plan: StepPlan, sampled: dict[str, int]) -> list[Request]:
        """Apply a run of `plan` whose sampling rows drew `sampled` (the engine tests'
        executor: no log probabilities); returns the requests that ended."""
        rids = list(sampled)
        result = StepResult.of(
            "", plan.step_id, "", rids, list(sampled.values()), [0.0] * len(rids)
        )
        return self.complete(plan, result)

    def complete(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Apply the executor's reply to `plan`, run or refused: the one step driver of
        the scheduler's step loop, the in-process runtime and the engine tests, so a
        refused step and a run step take the same path everywhere. Returns the requests
        that ended."""
        if result.error is not None:
            return self.step_refused(plan, result.error, result.ops_ran)
        return self.completion.apply(plan, result)

    def step_refused(self, plan: StepPlan, error: str, ops_ran: bool = False) -> list[Request]:
        """The executor refused `plan` (faults.py); returns the requests that ended."""
        return self.faults.refuse_step(plan, f"executor refused the step: {error}", ops_ran)

    def step_unsent(self, plan: StepPlan, error: str) -> list[Request]:
        """`plan` could not be put on the wire (faults.py); returns the requests that
        ended."""
        return self.faults.refuse_step(plan, f"the step could not be sent: {error}", ops_ran=False)

    def device_lost(self, suspect: bool = True) -> list[Request]:
        """The executor's device state is gone (faults.py); returns the requests that
        ended (quarantined)."""
        return self.faults.lose_device(suspect)

    # ---- views ----
    @property
    def waiting(self) -> deque[Request]:
        return self.queue.waiting

    @property
    def running(self) -> list[Request]:
        return self.queue.running

    @property
    def requests(self) -> dict[str, Request]:
        """Every request not yet ended, by id."""
        return self.queue.by_rid

    @property
    def retractions(self) -> int:
        return self.endings.retractions

    @property
    def quarantined(self) -> int:
        return self.faults.quarantined

    @property
    def cache_queries(self) -> int:
        return self.admission.cache_queries

    @property
    def cache_hits(self) -> int:
        return self.admission.cache_hits

    @property
    def cache_hit_tokens(self) -> int:
        return self.admission.cache_hit_tokens

    @property
    def idle(self) -> bool:
        queue = self.queue
        return not (queue.waiting or queue.running or self.in_flight or self.sessions.tier_work)

    def audit(self) -> IntegrityReport:
        """The check the idle loop runs: raises when strict, else logs and counts."""
        return self.guard.judge(self.check())

    def check(self, *, idle: bool | None = None) -> IntegrityReport:
        """Every holder's claims against the ledger, plus the cache and row-table checks."""
        claims = [c for r in self.queue.running for c in r.slots.claims(self.pools)]
        claims += self.sessions.claims() + self.cache.claims()
        claims += [c for plan in self.in_flight for c in plan.tier.claims()]
        report = check_integrity(
            self.pools.ledger, claims, idle=self.idle if idle is None else idle
        )
        report.problems += self.cache.problems() + self.pools.kv.integrity_problems()
        report.problems += borrow_problems(self.cache, self.pools.rows, self._borrowers())
        report.problems += [p for r in self.queue.running if (p := r.inflight_problem())]
        return report

    def _borrowers(self) -> Iterator[Borrower]:
        """Every holder of a row that may borrow cached KV: running requests, and
        sessions holding their state (between turns, or with a turn still waiting)."""
        for r in self.queue.running:
            yield f"request {r.rid}", r.slots.row.slot, r.slots.borrowed, r.cache_node
        for s in self.sessions.sessions.values():
            if s.slots is not None:
                name = f"session {session_name(s.sid)}"
                yield name, s.slots.row.slot, s.slots.borrowed, s.cache_node

    # ---- planning ----
    def _fit_running(
        self, req: Request, chosen: list, state: StepBudget, drafts: dict[str, list[int]]
    ) -> int:
        """Positions `req` computes this step (a verify row's drafts among them, put in
        `drafts`), after making KV room (evicting the cache, then
        retracting the newest unplanned requests with no step in flight); 0 if it cannot
        run now. A request planning ahead of its own step in flight retracts no one: it
        waits for that step. One without retracts victims, and if there are none it is
        retracted too, unless another request's step is in flight (which may end it or
        leave it a victim): it waits for that step. Two requests that each needed the
        other's pages once gave way to each other in turn for ever: one, pipelining its
        next chunk, retracted the other, re-admitted it took pages the first needed, and
        so on. A request with a step in flight is never the victim: that
        step's work (often the one that ends it) would be thrown away only to admit it
        again where it stood, and pipelined, with pages locked by requests sharing a
        prefix, requests then retract each other in turn for ever. Waiting is safe: a step
        in flight always comes back, and its requests are victims again after it."""
        pending, planned = req.pending_tokens, req.planned
        speculating = self.drafter is not None and verifiable(req)
        if speculating and pending:
            return 0  # its sampling steps run one deep: where the next starts is not known
        if pending and not self._may_follow(req, pending):
            return 0
        n = min(req.length + pending - planned, self.config.chunk_size, state.tokens)
        n = cut_at_checkpoint(
            req, planned, n, self.config.checkpoint_interval, self.pools.config.page_size
        )
        if n <= 0 or awaits_track_slot(req, n):
            return 0
        page_size = self.pools.config.page_size
        guesses = self._drafts(req, state.tokens - n) if speculating and n == 1 else []
        if guesses and not self.room.make(
            pages_to_grow(page_size, planned, n + len(guesses)) + state.pages, 0, 0
        ):
            guesses = []  # no room for the drafts' positions: a plain row, nobody retracted
        n += len(guesses)
        need = pages_to_grow(page_size, planned, n)
        running = self.queue.running
        # the pages taken so far fitted (rows only free room between): a row that grows
        # no page needs no check, the case of nearly every decoding row
        while need and not self.room.make(need + state.pages, 0, 0):
            if req.inflight:
                return 0  # planning ahead of its own step: it waits for it, retracting no one
            planned = {id(r) for r, _ in chosen}
            victims = [
                r
                for r in reversed(running)
                if r is not req and id(r) not in planned and not r.inflight
            ]
            if not victims:
                # it waits while a step in flight (its own or another's) may free room or
                # make a victim; only when none is in flight does it give way itself
                if not any(r.inflight or id(r) in planned for r in running):
                    self.endings.retract(req)
                return 0
            self.endings.retract(victims[0])
        state.take(n, need)
        if guesses:  # only now: a request that cannot run (retracted) verifies nothing
            drafts[req.rid] = guesses
        return n

    def _feeds_head(self, req: Request) -> int:
        """Guesses the MTP head makes from `req`'s row (0: it does not run for it)."""
        drafter = self.drafter
        by_head = drafter is not None and drafter.by_head and verifiable(req)
        return self.pools.config.spec_slots if by_head else 0

    def _drafts(self, req: Request, room: int) -> list[int]:
        """The drafts of `req`'s next row, a decode row (its last sampled token fed):
        at most one per speculative slot, none past its token limit or the context (the
        row gives one token more than it has drafts), none beyond the step's `room`."""
        if not req.output or req.computed != req.length - 1:
            return []
        limit = min(
            self.pools.config.spec_slots,
            req.params.max_new_tokens - len(req.output) - 1,
            self.config.context_len - req.length - 1,
            room,
        )
        if limit <= 0:
            return []
        return self.drafter.propose(req, limit)[:limit]

    def _may_follow(self, req: Request, pending: int) -> bool:
        """Whether `req`, with `pending` tokens still to be sampled by steps in flight, may
        have a row fed the last of them (a future token) in the step being planned. The
        executor fills a future token in from the step just before only, so its last row
        must be in the step this one builds on; penalties are counted from the output the
        scheduler knows plus that one token, so a penalised request waits for the
        others; and a request whose tokens in flight surely end it has nothing to plan."""
        if req.inflight[-1].step != self.in_flight.last_step:
            return False
        if pending > 1 and req.params.penalised:
            return False
        return length_limit(req, self.config.context_len, pending=pending) is None

    def _check_rid(self, rid: str) -> None:
        if rid in self.queue.by_rid:
            raise InvalidRequest(f"request id {rid} is already in use")
