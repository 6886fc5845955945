"""Runs the engine core against the data model, checking the busy invariant each step.

With `depth` 1 (the services' default) it drives the core as the scheduler service does:
it plans step N+1 before it completes step N, and the model runs each step only when it
is completed, so everything the core did meanwhile has happened first."""

from __future__ import annotations

import itertools

import numpy as np

from services.scheduler.allocators.pools import PoolConfig, Pools
from services.scheduler.engine.config import EngineConfig
from services.scheduler.engine.core import EngineCore
from services.scheduler.engine.drafts import Drafter
from services.scheduler.engine.step import StepPlan
from services.scheduler.records.request import Request
from services.scheduler.records.sampling import SamplingParams
from tests.engine.data_model import DataModelExecutor, result_of

VOCAB = 256


class Driver:
    def __init__(
        self,
        page_size: int = 1,
        kv_pages: int = 4096,
        mamba_slots: int = 64,
        rows: int = 16,
        context: int = 1024,
        chunk: int | None = None,
        step_tokens: int = 512,
        track_interval: int | None = None,
        checkpoint_interval: int = 0,
        junctions: bool = True,
        eos: int | tuple[int, ...] | None = None,
        depth: int = 1,
        host_pages: int = 0,
        host_slots: int = 0,
        disk_slots: int = 0,
        drafter: Drafter | None = None,
        drafts: int = 3,
    ) -> None:
        """`drafter`: the engine speculates, verifying up to `drafts` drafts a row."""
        self.pools = Pools(
            PoolConfig(
                kv_pages=kv_pages,
                page_size=page_size,
                mamba_slots=mamba_slots,
                max_running_requests=rows,
                max_context=context,
                host_kv_pages=host_pages,
                host_mamba_slots=host_slots,
                disk_slots=disk_slots,
                working_slots=max(2, depth + 1),
                spec_slots=drafts if drafter is not None else 0,
            )
        )
        self.engine = EngineCore(
            self.pools,
            EngineConfig(
                context_len=context,
                vocab_size=VOCAB,
                eos_token_ids=frozenset(eos if isinstance(eos, tuple) else {eos} - {None}),
                chunk_size=chunk or 64 * page_size,
                max_step_tokens=step_tokens,
                track_interval=track_interval or 4 * page_size,
                checkpoint_interval=checkpoint_interval,
                junctions=junctions,
            ),
            drafter=drafter,
        )
        self.model = DataModelExecutor(self.pools, VOCAB, self._sequence)
        self._rids = itertools.count(1)
        self.ended: dict[str, Request] = {}
        self.steps = 0
        self.depth = depth
        self.contexts: dict[int, list[np.ndarray]] = {}  # by step: each row's context

    def _sequence(self, rid: str) -> np.ndarray:
        return self.engine.requests[rid].sequence

    def rid(self) -> str:
        return f"r{next(self._rids)}"

    def step(self) -> list[Request]:
        """Plan a step; complete the oldest in flight when the pipeline is full or there
        was nothing new to plan."""
        engine = self.engine
        if len(engine.in_flight) > self.depth:  # left in flight by `plan_ahead`
            return self._complete_oldest()
        plan = self._plan()
        self.steps += plan is not None
        if not engine.in_flight or (plan is not None and len(engine.in_flight) <= self.depth):
            return []
        return self._complete_oldest()

    def plan_ahead(self) -> None:
        """Plan a step and leave it in flight, as the service does while it awaits the
        result (a fault can strike then)."""
        self.steps += self._plan() is not None

    def _plan(self) -> StepPlan | None:
        """Plan a step, noting each row's whole context as the row table has it now: the
        data model's page tables must resolve the rows' deltas to exactly that."""
        plan = self.engine.plan_step()
        if plan is not None:
            rows = self.pools.rows
            self.contexts[plan.step_id] = [
                rows.token_indices(r.wire.row, 0, r.end) for r in plan.rows
            ]
        return plan

    def _complete_oldest(self) -> list[Request]:
        engine = self.engine
        oldest = engine.in_flight[0]
        sampled = self.model.run(oldest, self.contexts.pop(oldest.step_id, None))
        ended = engine.complete(oldest, result_of(oldest, sampled, self.model.failed))
        for req in ended:
            self.ended[req.rid] = req
        report = self.engine.check()
        assert report.ok, "\n".join(report.problems)
        return ended

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if self.engine.idle:
                return
            self.step()
        raise AssertionError("the engine did not become idle")

    def generate(self, prompt, max_new: int = 12, **params) -> Request:
        req = Request(
            self.rid(), np.asarray(prompt), SamplingParams(max_new_tokens=max_new, **params)
        )
        self.engine.submit(req)
        return req

    def turn(
        self, sid: str, tokens, max_new: int = 12, session_params: dict | None = None, **params
    ) -> Request:
        params = SamplingParams(max_new_tokens=max_new, **params)
        session = self.engine.sessions.get(sid)  # as the HTTP edge resolves it, once
        return self.engine.submit_turn(
            session, np.asarray(tokens), self.rid(), params, session_params
        )

    def run_turn(self, sid: str, tokens, max_new: int = 12, **params) -> Request:
        req = self.turn(sid, tokens, max_new, **params)
        self.run()
        return req

    def assert_idle_clean(self) -> None:
        """Once the steps still in flight have come back, nothing is held."""
        self.run()
        assert self.engine.idle
        report = self.engine.check(idle=True)
        assert report.ok, "\n".join(report.problems)
